"""`runner -m`: every job runs, failures stay visible, the sweep root gets its table."""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.cli import FAST, child_env, run_sweep
from tests.helpers.wandb_records import records

pytestmark = [pytest.mark.slow, pytest.mark.sweeps]
TINY = [*FAST, "max_epochs=null", "max_steps=2", "log_interval=1"]


def table(root: Path) -> list[dict[str, str]]:
    with open(root / "sweep.csv") as f:
        return list(csv.DictReader(f))


def test_failing_jobs_do_not_stop_the_sweep_and_are_listed(tmp_path: Path) -> None:
    # job 0 completes, 1 and 3 are rejected (63 is odd), 2 loses rank 1 at step 2
    proc, root = run_sweep(
        tmp_path, *TINY, "chaos.kill_rank=1", "chaos.at_step=5,2", "global_batch_size=64,63"
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = table(root)
    assert [r["status"] for r in rows] == ["completed", "failed", "failed", "failed"]
    assert rows[0]["overrides"] == "chaos.at_step=5 global_batch_size=64"
    assert float(rows[0]["val/accuracy"]) > 0 and rows[0]["steps"] == "2"
    for rejected in (rows[1], rows[3]):  # kept visible, with why they never started
        assert rejected["error"].startswith("invalid configuration: global_batch_size=63")
    assert rows[2]["error"].startswith("rank 1")
    assert "runner: 3 job(s) failed: 1, 2, 3" in proc.stderr
    markdown = (root / "sweep.md").read_text()
    assert "overrides of every job: " in markdown and "chaos.kill_rank=1" in markdown
    assert "| 2 | chaos.at_step=2 global_batch_size=64 | failed |" in markdown
    assert markdown in proc.stdout  # printed at the end, too

    report = subprocess.run(
        [sys.executable, "-m", "runner.cli.report", str(root)],
        capture_output=True,
        text=True,
        env=child_env(),
    )
    assert report.returncode == 0, report.stderr
    header = report.stdout.splitlines()[1]
    for column in ("run", "chaos.at_step", "global_batch_size", "status", "val/accuracy"):
        assert column in header
    assert "seed" not in header  # the same in every job: not a difference
    assert (root / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = subprocess.run(
        [sys.executable, "-m", "runner.cli.report", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        env=child_env(),
    )
    assert missing.returncode == 2 and "no such directory" in missing.stderr


def test_submitit_runs_jobs_side_by_side(tmp_path: Path) -> None:
    """Two jobs at once, logging to MLflow and W&B: the sweep is one MLflow parent run (made
    once, whichever job comes first) with a child per job, and one W&B group."""
    trackers = ["logger=[mlflow,wandb]"]
    proc, root = run_sweep(tmp_path, *TINY, "hydra/launcher=submitit_local", "seed=1,2", *trackers)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = table(root)
    assert [(r["job"], r["status"]) for r in rows] == [("0", "completed"), ("1", "completed")]
    assert rows[0]["train/loss"] != rows[1]["train/loss"]  # different seeds really ran
    for job in ("0", "1"):
        assert (root / job / "model.pt").is_file()

    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("runner").experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(runs) == 3 and len(children) == 2
    assert parent.info.run_name == "sweep" and parent.info.status == "FINISHED"
    assert {"sweep.csv", "sweep.md"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert sorted(c.data.params["seed"] for c in children) == ["1", "2"]
    assert sorted(c.info.run_name for c in children) == ["sweep/0", "sweep/1"]
    assert all(c.info.status == "FINISHED" for c in children)
    for job in ("0", "1"):
        (log,) = (root / job).glob("wandb/offline-run-*/run-*.wandb")
        run = next(r.run for r in records(log) if r.WhichOneof("record_type") == "run")
        assert (run.run_group, run.display_name) == ("sweep", f"sweep/{job}")


def test_optuna_maximises_the_returned_validation_accuracy(tmp_path: Path) -> None:
    """Optuna asks for 2 trials at once (n_jobs=2); the joblib launcher runs them side by side."""
    proc, root = run_sweep(
        tmp_path,
        *TINY,
        "hydra/sweeper=optuna",
        "hydra/launcher=joblib",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.n_jobs=2",
        "hydra.sweeper.direction=maximize",
        "optimizer.lr=interval(0.0001,0.01)",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "setup plugin alembic" not in proc.stdout + proc.stderr  # Optuna's storage, quiet
    rows = table(root)
    assert [(r["job"], r["status"]) for r in rows] == [("0", "completed"), ("1", "completed")]
    assert all((root / r["job"] / "model.pt").is_file() for r in rows)
    accuracies = [float(r["val/accuracy"]) for r in rows]
    result = yaml.safe_load((root / "optimization_results.yaml").read_text())
    assert len(accuracies) == 2 and not any(math.isnan(a) for a in accuracies)
    assert result["best_value"] == pytest.approx(max(accuracies))


def test_an_optuna_sweep_the_wrong_way_round_stops_before_any_job(tmp_path: Path) -> None:
    """The mlp's sweep.metric is val/accuracy (to maximize): minimizing it is refused."""
    proc, root = run_sweep(
        tmp_path,
        *TINY,
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.direction=minimize",
        "optimizer.lr=interval(0.0001,0.01)",
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert (
        "hydra.sweeper.direction=minimize: each job returns its final val/accuracy "
        "(sweep.metric), which is to maximize (sweep.direction)" in proc.stderr
    )
    assert "Traceback" not in proc.stderr
    assert "Launching" not in proc.stdout + proc.stderr  # refused before Hydra lists a job
    assert not any(root.glob("*/model.pt")) and not any(root.glob("*/logs"))


def test_a_slurm_sweep_runner_cannot_run_is_refused_before_any_job_is_sent(
    tmp_path: Path,
) -> None:
    """Checked as the sweep starts, on the submitting host: no SLURM needed, none asked."""
    proc, root = run_sweep(
        tmp_path, *TINY, "hydra/launcher=submitit_slurm", "hydra.launcher.tasks_per_node=2",
        "seed=1,2",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "hydra.launcher.tasks_per_node=2: runner runs one task per node" in proc.stderr
    assert "Traceback" not in proc.stderr and not root.exists()
