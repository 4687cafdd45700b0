"""Nothing a launcher refuses is written into a finished run or sweep: under Hydra's default
launcher (and joblib), another sweep's command in a sweep's directory is refused before Hydra
writes anything there, the same command again keeps what ended, and a refused run leaves a
finished run's `.hydra/` as it was. (58fe533 rewrote the finished job's summary.json to
`failed`, replaced its overrides.yaml and listed its metrics under the new overrides.)"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tests.helpers.cli import FAST, run_cli, run_sweep

pytestmark = [pytest.mark.slow, pytest.mark.sweeps]
TINY = [*FAST, "nproc=1", "max_epochs=null", "max_steps=2", "eval_interval=1000"]


def _files(root: Path) -> dict[str, str]:
    """Every file below `root` (dot files too) and a digest of its bytes."""
    return {
        str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file() and ".lock" not in p.name
    }


@pytest.fixture(scope="module")
def finished_sweep(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A completed sweep (seed=1,2) under Hydra's default launcher, and its files."""
    tmp = tmp_path_factory.mktemp("finished")
    proc, root = run_sweep(tmp, *TINY, "seed=1,2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return root, _files(root)


@pytest.mark.parametrize("launcher", ["basic", "joblib"])
def test_another_sweep_in_a_finished_sweeps_directory_is_refused_untouched(
    tmp_path: Path, finished_sweep: tuple[Path, dict[str, str]], launcher: str
) -> None:
    root, before = finished_sweep
    proc, _ = run_sweep(tmp_path, *TINY, f"hydra/launcher={launcher}", "seed=3,4", root=root)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        f"hydra.sweep.dir={root} holds another sweep (there only: seed=1,2; here only: "
        "seed=3,4)" in proc.stderr
    )
    assert "Launching" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    assert _files(root) == before


def test_the_same_sweep_again_keeps_its_finished_jobs(
    tmp_path: Path, finished_sweep: tuple[Path, dict[str, str]]
) -> None:
    root, before = finished_sweep
    proc, _ = run_sweep(tmp_path, *TINY, "seed=1,2", root=root)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "runner: job 0 kept as it ended (completed)" in proc.stderr
    assert "runner: job 1 kept as it ended (completed)" in proc.stderr
    after = _files(root)
    kept = [name for name in before if not name.startswith(("sweep.", "multirun.yaml"))]
    assert {name: after[name] for name in kept} == {name: before[name] for name in kept}


def test_a_refused_run_leaves_a_finished_runs_hydra_files(
    tmp_path: Path, finished_sweep: tuple[Path, dict[str, str]]
) -> None:
    job = finished_sweep[0] / "0"
    before = _files(job)
    result = run_cli(tmp_path, *TINY, "seed=9", name=str(job))  # an absolute name: job itself
    assert result.returncode == 2, result.output
    assert "already holds a run" in result.stderr and "Traceback" not in result.stderr
    assert _files(job) == before
