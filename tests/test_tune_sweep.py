"""hydra/launcher=tune: a sweep's jobs as Ray Tune trials on a real local Ray cluster. Each
trial gets its job's resources (its own GPUs, declared on this CPU host), ASHA prunes a job
that falls behind (with a checkpoint and status `pruned`), a signal stops the running jobs
as it stops a run, and the same command again keeps what ended and resumes the rest."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from runner.sweeps.ray_cluster import resource_problems
from tests.helpers.cli import FAST, HANG, run_sweep, start_runner, wait_until

# SLURM's and Ray's processes as they start them: no warm server (tests/helpers/warm.py)
COLD_START = True

TUNE = "hydra/launcher=tune"
SHORT = [*FAST, "max_epochs=null", "nproc=1", "eval_interval=20", "log_interval=20"]


def _launcher(**settings) -> SimpleNamespace:
    values = {"cpus_per_trial": None, "gpus_per_trial": None, **settings}
    return SimpleNamespace(**values)


def test_a_trial_no_node_can_hold_is_refused() -> None:
    """A job's ranks take a GPU each on a GPU cluster, a CPU each otherwise; the largest
    node must hold one trial."""
    gpu_node = {"CPU": 16.0, "GPU": 8.0}
    assert resource_problems(gpu_node, _launcher(), [2, 8]) == []
    [problem] = resource_problems(gpu_node, _launcher(), [16])
    assert problem.startswith("nproc=16: a trial asks for 16 GPU(s)")
    assert "no node of the Ray cluster has more than 8" in problem
    [problem] = resource_problems({"CPU": 2.0}, _launcher(), [4])
    assert "4 CPU(s)" in problem and "more than 2" in problem
    assert resource_problems({"CPU": 2.0}, _launcher(cpus_per_trial=0.5), [4]) == []


def _steps(metrics: Path) -> int:
    from runner.rundir.files import read_jsonl

    return max((record.get("step", 0) for record in read_jsonl(metrics)), default=0)


def _summary(job: Path) -> dict:
    return json.loads((job / "summary.json").read_text())


@pytest.mark.slow
def test_bad_settings_are_refused_before_ray_starts(tmp_path: Path) -> None:
    proc, root = run_sweep(
        tmp_path, TUNE, *SHORT, "optimizer.lr=0.1,0.01", "max_steps=20", "launcher=ray",
        "hydra.launcher.scheduler=hyperband", "sweep.metric=train/loss",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "launcher=ray: hydra/launcher=tune runs each job's ranks" in proc.stderr
    assert "hydra.launcher.scheduler=hyperband: not a scheduler; valid: null" in proc.stderr
    assert "sweep.metric=train/loss is not one (valid: val/loss, val/accuracy)" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (root / "0").exists()


@pytest.mark.slow
@pytest.mark.ray
def test_asha_prunes_the_trial_that_falls_behind_and_a_rerun_keeps_every_job(
    tmp_path: Path,
) -> None:
    """One trial at a time: the good learning rate sets the first rung; the one that does not
    learn falls below it and is pruned there, with a checkpoint. The same command again
    keeps both jobs as they ended (their evaluations replayed to ASHA, nothing trained)."""
    sweep = [
        TUNE, *SHORT, "optimizer.lr=0.05,1e-7", "max_steps=200", "checkpoint.interval=20",
        "hydra.launcher.scheduler=asha", "hydra.launcher.reduction_factor=2",
        "hydra.launcher.max_concurrent_trials=1",
    ]  # fmt: skip
    proc, root = run_sweep(tmp_path, *sweep)
    assert proc.returncode == 0, proc.stderr
    assert "2 job(s) as Ray Tune trials (asha on val/accuracy: grace period 20 steps" in proc.stderr
    assert _summary(root / "0")["status"] == "completed"
    pruned = _summary(root / "1")
    assert pruned["status"] == "pruned", pruned
    assert pruned["pruned"]["after_step"] == 20
    assert (root / "1" / pruned["pruned"]["checkpoint"]).is_dir()
    assert "runner: job 1 pruned by ASHA after step 20" in proc.stderr
    assert "| 1 | optimizer.lr=1e-07 | pruned | 20 |" in (root / "sweep.md").read_text()
    assert "sweep: 1 done, 0 running, 0 queued, 0 failed, 1 pruned; best val/accuracy" in (
        proc.stderr
    )
    before = {job: (root / job / "summary.json").stat().st_mtime_ns for job in ("0", "1")}

    again, _ = run_sweep(tmp_path, *sweep)
    assert again.returncode == 0, again.stderr
    assert "2 job(s) kept as they ended, 0 going on from their last checkpoint" in again.stderr
    assert "0 job(s) as Ray Tune trials" in again.stderr
    assert "started as Tune trial" not in again.stderr
    after = {job: (root / job / "summary.json").stat().st_mtime_ns for job in ("0", "1")}
    assert after == before


@pytest.mark.slow
@pytest.mark.ray
def test_each_trial_runs_on_its_own_gpus_and_a_stopped_sweep_resumes(tmp_path: Path) -> None:
    """A local cluster with two (declared) GPUs: two one-rank jobs run side by side, each
    seeing only its own GPU (CUDA_VISIBLE_DEVICES in env.json; training runs on the CPU).
    SIGINT stops both as it stops a run (interrupted, with their summaries); the same command
    again takes them on from their checkpoints to the end."""
    root = tmp_path / "sweep"
    sweep = [
        TUNE, *SHORT, "optimizer.lr=0.05,0.04", "max_steps=4000", "checkpoint.interval=100",
        "hydra.launcher.gpus=2", f"hydra.sweep.dir={root}",
    ]  # fmt: skip
    proc = start_runner(tmp_path, root, "-m", *sweep)
    started = [root / job / "metrics.jsonl" for job in ("0", "1")]
    wait_until(proc, lambda: all(_steps(p) >= 200 for p in started))
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=HANG)
    assert proc.returncode == 1, err
    assert "runner: SIGINT: stopping every running trial; no other starts" in err
    assert "1 CPU, 1 GPU" in err
    visible = set()
    for job in ("0", "1"):
        assert _summary(root / job)["status"] == "interrupted"
        env = json.loads((root / job / "env.json").read_text())
        visible.add(env["devices"]["CUDA_VISIBLE_DEVICES"])
    assert visible == {"0", "1"}

    again, _ = run_sweep(tmp_path, *sweep[:-1], root=root)
    assert again.returncode == 0, again.stderr
    assert "0 job(s) kept as they ended, 2 going on from their last checkpoint" in again.stderr
    for job in ("0", "1"):
        summary = _summary(root / job)
        assert summary["status"] == "completed" and summary["steps"] == 4000, summary
        assert summary["resumed_from"], summary
