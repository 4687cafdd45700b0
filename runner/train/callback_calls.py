"""The run's callbacks (runner.callbacks), built on each rank and called at their hooks.

A hook that raises stops the run: the error names the callback, the hook and the rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runner.callbacks import HOOKS, Run
from runner.components import instantiate
from runner.errors import describe
from runner.spec import RunSpec


class CallbackError(RuntimeError):
    """A user's callback raised; the message names it, its hook and the rank."""


class Callbacks:
    def __init__(self, spec: RunSpec, run: Run):
        self.run = run
        self.entries = [
            (f"callbacks[{i}] ({c.target})", instantiate(c.node))
            for i, c in enumerate(spec.callbacks)
            if c.ranks == "all" or run.is_main
        ]

    def call(self, hook: str, *value: Any, step: int | None = None) -> None:
        """Call `hook` of every callback that has it, in the order configured."""
        assert hook in HOOKS, hook
        if step is not None:
            self.run.step = step
        for name, callback in self.entries:
            method = getattr(callback, hook, None)
            if method is None:
                continue
            try:
                method(self.run, *value)
            except Exception as exc:
                raise CallbackError(
                    f"{name} raised in {hook} on rank {self.run.rank}: {describe(exc)}"
                ) from exc

    def checkpoint_saved(self, path: Path, step: int) -> None:
        self.call("on_checkpoint_saved", path, step=step)
