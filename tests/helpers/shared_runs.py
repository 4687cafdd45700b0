"""Runs that several tests read, made once: `SharedRuns(root, base)(*overrides)` runs `runner
*base *overrides` the first time it is asked for those overrides, and hands the same result
to every later caller (a module-scoped fixture holds one; tests/conftest.py's
once_per_session shares a run between the workers). A claim that needs a run pair (a killed
run and its uninterrupted twin) asks for the twin here, and so shares it with every other
claim that needs it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tests.helpers.cli import CliResult, run_cli


class SharedRuns:
    def __init__(self, root: Path, base: Sequence[str] = ()) -> None:
        self.root = root
        self.base = list(base)
        self.made: dict[tuple[str, ...], CliResult] = {}

    def __call__(self, *overrides: str, completes: bool = True) -> CliResult:
        """The run of these overrides on the base (asserted to complete, unless told)."""
        if overrides not in self.made:
            name = f"run{len(self.made)}"
            self.made[overrides] = run_cli(self.root, *self.base, *overrides, name=name)
        result = self.made[overrides]
        if completes:
            assert result.returncode == 0, result.output
        return result
