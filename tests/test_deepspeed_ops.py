"""DeepSpeed's CPU communication op is built once per install: whichever ninja comes first on
the user's PATH (an activated venv's, or the system's under `.venv/bin/runner`), runner builds
with the environment's own, and a build that does run is announced on the terminal."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runner.processes import environments_ninja, keep_extensions_in_environment

SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"


def test_runner_builds_with_the_environments_ninja_whatever_the_path(monkeypatch) -> None:
    ninja = environments_ninja()
    if ninja is None:
        pytest.skip("this environment has no ninja of its own")
    venv_bin = str(Path(sys.executable).parent)
    for path in (SYSTEM_PATH, os.pathsep.join([venv_bin, SYSTEM_PATH])):
        monkeypatch.setenv("PATH", path)
        keep_extensions_in_environment()
        assert os.path.realpath(shutil.which("ninja") or "") == ninja, path


@pytest.mark.slow  # DeepSpeed's load runs ninja and the compiler's version checks
def test_a_build_says_what_it_does_and_how_long_it_took(monkeypatch, tmp_path) -> None:
    pytest.importorskip("deepspeed")
    from runner.engines import deepspeed_ops

    monkeypatch.setattr(deepspeed_ops, "QUIET_S", 0.0)  # every load counts as a build
    monkeypatch.setattr(deepspeed_ops, "_times_file", lambda: tmp_path / "times.json")
    said: list[str] = []
    deepspeed_ops.load_shared_memory_op(said.append)
    assert said[0].startswith("building DeepSpeed's CPU communication op"), said
    assert "usually" in said[0] and "make install builds it ahead" in said[0]
    assert said[-1].startswith("DeepSpeed's deepspeed_shm_comm op built in"), said
    assert deepspeed_ops.last_build_seconds("deepspeed_shm_comm") is not None
    assert "the last build here took" in deepspeed_ops.building_message("deepspeed_shm_comm")


# Each way runner first imports DeepSpeed in a process: a CPU rank's op load, an engine's
# import, and reading a ZeRO checkpoint's weights (runner eval, runner export).
FIRST_IMPORTS = {
    "op": "from runner.engines import deepspeed_ops; deepspeed_ops._builder()",
    "engine": "from runner.engines.deepspeed_ops import import_deepspeed; "
    "import_deepspeed('zero2', 'cpu')",
    "weights": "from pathlib import Path\nfrom runner.models import checkpoint_weights\n"
    "try: checkpoint_weights._deepspeed(Path('/nowhere'), Path('/nowhere'))\n"
    "except FileNotFoundError: pass",  # imported, then found no checkpoint there
}


@pytest.mark.slow  # a child interpreter: this one may have imported MLflow already
@pytest.mark.parametrize("first", sorted(FIRST_IMPORTS))
def test_deepspeed_loads_without_mlflow_which_a_rank_can_import_after(first: str) -> None:
    """DeepSpeed's autotuner imports MLflow as DeepSpeed loads, where it is installed: 1.3 s
    of CPU in every rank of a DeepSpeed run, for an autotuner runner never runs (the op
    loader added in the issue before this one imported DeepSpeed without hiding it)."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("mlflow")
    check = (
        f"{FIRST_IMPORTS[first]}\nimport sys\nassert 'deepspeed' in sys.modules\n"
        "assert 'mlflow' not in sys.modules, 'DeepSpeed imported MLflow'\n"
        "import mlflow\nprint('ok')"
    )
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


@pytest.mark.slow
def test_switching_between_the_activated_venv_and_its_runner_never_rebuilds_the_op() -> None:
    """With the venv first on PATH and with the system's ninja first, loading the op built at
    install finds it up to date (it rebuilt for minutes at every switch: 58fe533)."""
    pytest.importorskip("deepspeed")
    venv_bin = str(Path(sys.executable).parent)
    built: list[float] = []
    for path in (SYSTEM_PATH, os.pathsep.join([venv_bin, SYSTEM_PATH]), SYSTEM_PATH):
        env = {**os.environ, "PATH": path}
        done = subprocess.run(
            [sys.executable, "-m", "runner.engines.deepspeed_ops"],
            capture_output=True, text=True, env=env, timeout=900,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        library = next(Path(sys.prefix, "torch_extensions").rglob("deepspeed_shm_comm.so"))
        built.append(library.stat().st_mtime)
        if len(built) > 1:  # the first load may build, where nothing did before
            assert "building" not in done.stderr, (path, done.stderr)
    assert built[1] == built[2] == built[0], built
