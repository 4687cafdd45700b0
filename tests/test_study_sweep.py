"""hydra/sweeper=runner: Optuna's search with its study kept in the sweep directory (a sweep
run again there goes on with it) and a pruner that stops trials falling behind, each a
`pruned` job with a checkpoint; bad input refused before the first job."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest

from runner.spec import resolve_spec
from runner.sweeps.job_dirs import overrides_of
from runner.sweeps.study_server import KEY_ENV, StudyServer, report
from runner.sweeps.study_sweep import _consecutive, sweep_problems
from tests.helpers.cli import FAST, HANG, run_sweep
from tests.helpers.config import compose_config

SWEEPER = ["hydra/sweeper=runner", "hydra/launcher=runner", "hydra.launcher.devices=[0,1]"]


def test_unfinished_trials_go_on_in_runs_of_consecutive_numbers() -> None:
    assert _consecutive([2, 3, 4, 7, 9, 10], 2) == [[2, 3], [4], [7], [9, 10]]
    assert _consecutive([], 4) == []


def test_a_pruner_needs_a_metric_each_evaluation_reports() -> None:
    spec = resolve_spec(compose_config([*FAST, "sweep.metric=train/loss", "device=cpu"]))
    (problem,) = sweep_problems(spec, None, {"name": "median"}, None)
    assert problem.startswith("hydra/sweeper/pruner=median: a pruner reads sweep.metric at each")
    assert "sweep.metric=train/loss is not one (valid: val/loss" in problem
    (problem,) = sweep_problems(spec, "maximize", None, None)
    assert problem.startswith("hydra.sweeper.direction=maximize: each job returns its final")
    (problem,) = sweep_problems(spec, None, None, "maximize")
    assert "its study (study.json) is to maximize train/loss, this sweep's to minimize" in problem


def test_the_study_answers_reports_only_to_those_with_its_key(monkeypatch) -> None:
    heard = []

    def on_report(number: int, step: int, value: float) -> bool:
        heard.append((number, step, value))
        return value < 0.5

    server = StudyServer(on_report)
    server.start()
    try:
        assert report(server.address, 3, 10, 0.9) is False
        assert report(server.address, 3, 20, 0.1) is True
        assert heard == [(3, 10, 0.9), (3, 20, 0.1)]
        monkeypatch.setenv(KEY_ENV, "00" * 32)
        with pytest.raises(Exception, match="digest"):
            report(server.address, 3, 30, 0.1)
        assert len(heard) == 2
    finally:
        server.close()


def test_the_study_kept_in_the_sweep_directory_is_rebuilt_number_for_number(
    tmp_path: Path,
) -> None:
    import optuna

    from runner.sweeps.study import make_pruner, read_study_file, rebuild_study, write_study_file

    space = {"optimizer.lr": optuna.distributions.LogUniformDistribution(1e-4, 1e-1)}
    study = optuna.create_study(direction="maximize", pruner=make_pruner({"name": "median"}))
    trials = [study.ask(space) for _ in range(4)]
    trials[0].report(0.5, 10)
    study.tell(0, 0.9)
    trials[1].report(0.2, 10)
    study.tell(1, state=optuna.trial.TrialState.PRUNED)
    study.tell(2, state=optuna.trial.TrialState.FAIL)  # 3 is still running
    write_study_file(tmp_path, study, "sweep")

    again = optuna.create_study(direction="maximize")
    assert rebuild_study(again, read_study_file(tmp_path)) == [3]
    kept = again.trials
    assert [t.state.name for t in kept] == ["COMPLETE", "PRUNED", "FAIL", "WAITING"]
    assert kept[0].value == 0.9 and kept[0].intermediate_values == {10: 0.5}
    assert kept[1].intermediate_values == {10: 0.2} and kept[0].params == trials[0].params
    going_on = again.ask(space)  # the unfinished trial, under its own number and values
    assert going_on.number == 3 and going_on.params == trials[3].params
    assert again.ask(space).number == 4


def test_a_signal_after_rank_0_ended_the_run_leaves_its_summary(tmp_path: Path) -> None:
    """A pruned job (or a completed one) whose agent is signalled as it exits (its sweep
    killed): the summary rank 0 wrote stands; one no rank wrote says interrupted."""
    from runner.launch.outcomes import outcome_writer
    from runner.rundir.files import RunDir, write_json

    spec = resolve_spec(compose_config([*FAST, "device=cpu"]))
    write = outcome_writer(spec, tmp_path, time.time())
    ended, unended = RunDir(tmp_path / "ended"), RunDir(tmp_path / "unended")
    for run_dir in (ended, unended):
        run_dir.root.mkdir()
    write_json(ended.summary, {"status": "pruned", "steps": 10})
    write(ended, "interrupted")
    write(unended, "interrupted")
    assert json.loads(ended.summary.read_text()) == {"status": "pruned", "steps": 10}
    assert json.loads(unended.summary.read_text())["status"] == "interrupted"


def _status(job: Path) -> str | None:
    summary = job / "summary.json"
    return json.loads(summary.read_text()).get("status") if summary.is_file() else None


@pytest.mark.slow
@pytest.mark.sweeps
def test_a_pruned_sweep_killed_and_run_again_keeps_its_study(tmp_path: Path) -> None:
    """Four trials, two at a time, of a learning rate that trains (0.05) or does not (1e-7):
    seeded so that each pair has one of each. The first pair completes (the pruner waits for
    one finished trial); in the second, the trial that does not train is pruned after its
    first evaluation, with a checkpoint. The sweep is then SIGKILLed while the other trial
    trains: the same command goes on with the study, keeps the three trials that ended and
    takes the fourth on from its checkpoint, to the weights of its twin that never stopped."""
    import torch

    from tests.helpers.cli import start_runner

    root = tmp_path / "sweep"
    overrides = [
        *SWEEPER, "hydra/sweeper/pruner=median", "hydra.sweeper.pruner.n_startup_trials=1",
        "hydra.sweeper.n_trials=4", "hydra.sweeper.n_jobs=2", "hydra.sweeper.sampler.seed=9",
        "optimizer.lr=choice(0.05,1e-7)", *FAST, "nproc=1", "max_epochs=null",
        "max_steps=300", "eval_interval=10", "log_interval=10", "checkpoint.interval=10",
    ]  # fmt: skip
    proc = start_runner(tmp_path, root, "-m", *overrides, f"hydra.sweep.dir={root}")
    deadline = time.monotonic() + HANG
    jobs = [root / str(n) for n in range(4)]

    def one_pruned_one_saved() -> bool:
        statuses = [_status(job) for job in jobs[2:]]
        if sorted(statuses, key=str) != [None, "pruned"]:
            return False
        going = jobs[2 + statuses.index(None)]
        return any(going.glob("checkpoints/step_*"))

    while not one_pruned_one_saved():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=HANG)
    pruned, going = (jobs[2], jobs[3]) if _status(jobs[2]) == "pruned" else (jobs[3], jobs[2])
    while _status(going) != "interrupted":  # the kernel's SIGTERM, as the sweep died
        assert time.monotonic() < deadline, _status(going)
        time.sleep(0.1)
    assert [_status(job) for job in jobs[:2]] == ["completed", "completed"]
    summary = json.loads((pruned / "summary.json").read_text())
    assert summary["pruned"]["after_step"] == 10 and summary["steps"] == 10
    assert summary["pruned"]["checkpoint"] == "checkpoints/step_00000010"
    assert (pruned / summary["pruned"]["checkpoint"]).is_dir()
    assert not (pruned / "model.pt").exists()  # not a finished run's weights
    study = json.loads((root / "study.json").read_text())  # told as the pair ends: not yet
    states = [t["state"] for t in study["trials"]]
    assert states == ["COMPLETE", "COMPLETE", "RUNNING", "RUNNING"]

    again, _ = run_sweep(tmp_path, *overrides, root=root)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "setup plugin alembic" not in again.stdout + again.stderr  # Optuna's storage, quiet
    assert f"going on with the study in {root}: 2 trial(s) ended, 2 to go on" in again.stderr
    assert "1 job(s) kept as they ended, 1 going on from their last checkpoint" in again.stderr
    study = json.loads((root / "study.json").read_text())
    states = {t["number"]: t["state"] for t in study["trials"]}
    assert states[int(pruned.name)] == "PRUNED" and states[int(going.name)] == "COMPLETE"
    resumed = json.loads((going / "summary.json").read_text())
    assert resumed["status"] == "completed" and resumed["resumed_from"] >= 10, resumed
    lr = [o for o in overrides_of(going) if o.startswith("optimizer.lr=")]
    twin = next(job for job in jobs[:2] if lr[0] in overrides_of(job))
    expected = torch.load(twin / "model.pt", weights_only=True)
    got = torch.load(going / "model.pt", weights_only=True)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    results = (root / "optimization_results.yaml").read_text()
    assert "complete: 3" in results and "pruned: 1" in results
    table = (root / "sweep.md").read_text()
    assert "| pruned | 10 |" in table and table.count("| completed |") == 3


@pytest.mark.slow
@pytest.mark.sweeps
def test_a_pruner_with_a_metric_no_evaluation_reports_is_refused(tmp_path: Path) -> None:
    done, root = run_sweep(
        tmp_path, *SWEEPER, "hydra/sweeper/pruner=asha", "sweep.metric=train/loss",
        "optimizer.lr=interval(0.001,0.1)", *FAST,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "hydra/sweeper/pruner=asha: a pruner reads sweep.metric at each" in done.stderr
    assert "Traceback" not in done.stderr and not root.exists()


@pytest.mark.slow
@pytest.mark.sweeps
def test_a_pruner_whose_jobs_run_on_other_hosts_is_refused(tmp_path: Path) -> None:
    """submitit_slurm's jobs cannot reach the sweep's study: refused, nothing submitted."""
    done, root = run_sweep(
        tmp_path, "hydra/sweeper=runner", "hydra/launcher=submitit_slurm",
        "hydra/sweeper/pruner=median", "optimizer.lr=interval(0.001,0.1)", *FAST,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "the jobs of hydra/launcher=submitit_slurm run on other hosts" in done.stderr
    assert "Traceback" not in done.stderr and not root.exists()
