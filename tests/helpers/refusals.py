"""What `runner OVERRIDES` refuses before any rank starts, found in the test's own process by
the code the command runs, in its order: Hydra's composition (its errors as runner words
them), the parent's checks of the spec, the parent's look at the checkpoint a run resumes
from, then the agent's checks of the components (imports, signatures, the model's blocks
and plans, the data). No process starts: a refusal costs milliseconds, not a launch.

Each kind of refusal keeps one test through the real command (exit 2, one short message,
no traceback, nothing written): tests/test_bad_input.py's CLI cases."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from tests.helpers.cli import CONF_DIR


def refusal(*overrides: str, run_dir: Path | None = None, components: bool = True) -> list[str]:
    """Every problem the command would name, as it names them; [] if the run would start.
    `components=False` stops after the parent's checks (no torch, no user code)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException

    from runner.cli.command_line import expand_shorthands
    from runner.cli.compose_errors import composition_problems, with_origins
    from runner.cli.resume_point import resume_problems
    from runner.spec import SpecError
    from runner.spec.composed import resolve_cfg

    given = expand_shorthands(list(overrides))  # init_from=PATH, as the command reads it
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=given)
    except HydraException as exc:
        return composition_problems(exc, given, str(CONF_DIR))
    with tempfile.TemporaryDirectory(prefix="runner-refusal-") as empty:
        where = run_dir if run_dir is not None else Path(empty) / "run"  # a new run's
        try:
            spec, _ = resolve_cfg(cfg, where)
        except SpecError as err:
            return err.problems
        damaged = resume_problems(spec, where)
    if damaged or not components:
        return damaged
    from runner.launch.preflight import component_problems

    before, imported = list(sys.path), set(sys.modules)
    added = [Path.cwd(), *(Path(d).resolve() for d in spec.code_dir)]  # as runner adds them
    try:
        sys.path[:0] = [str(d) for d in added]
        return with_origins(component_problems(spec), given)
    finally:
        sys.path[:] = before
        _forget_user_modules(set(sys.modules) - imported, added)


def _forget_user_modules(names: set[str], directories: list[Path]) -> None:
    """The modules a check imported from the user's directories (another test's may hold
    other modules of the same name); never runner's, the venv's or the standard library's
    (a compiled extension imported twice aborts the process)."""
    kept = (Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(), CONF_DIR.parent)
    users = [d for d in directories if not any(k.is_relative_to(d) for k in kept)]
    for name in names:
        where = getattr(sys.modules[name], "__file__", None)
        if where and any(Path(where).resolve().is_relative_to(d) for d in users):
            del sys.modules[name]


def refused(*overrides: str, run_dir: Path | None = None) -> str:
    """The problems of `refusal`, one per line (for `assert "..." in refused(...)`); fails
    when there are none: the run would have started."""
    found = refusal(*overrides, run_dir=run_dir)
    assert found, f"not refused: runner {' '.join(overrides)}"
    return "\n".join(found)
