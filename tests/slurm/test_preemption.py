"""Time limits, preemption and scancel through the real cluster: 2 nodes x 2 ranks, srun.

The model sleeps in each forward pass on the job's first start only
(tests/slurm/slow_model.py), so that SLURM's signal or requeue lands mid-run; the job
started again is fast. Its weights are compared bit for bit with an uninterrupted job's.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers.cli import runner_command
from tests.slurm import jobs
from tests.slurm.jobs import SUBMITIT_2_NODES

# SLURM's and Ray's processes as they start them: no warm server (tests/helpers/warm.py)
COLD_START = True

STEPS = 240
TRAIN = [
    *jobs.FAST,
    "max_epochs=null",
    f"max_steps={STEPS}",
    "checkpoint.interval=40",
    "model._target_=tests.slurm.slow_model.mlp_slow_on_first_start",
    f"code_dir=[{jobs.REPO}]",
    "nodes=auto",
    "nproc=2",
]
TWO_NODES = ["-N 2", "--ntasks-per-node=1", "--requeue"]
SLOW = "export RUNNER_TEST_STEP_DELAY_S=0.25"  # 60 s for the whole run on a first start


def summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(slurm, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The same job on the same 2 x 2 ranks, never signalled (and never slowed down)."""
    where = tmp_path_factory.mktemp("uninterrupted")
    run = where / "run"
    job = jobs.submit(slurm, jobs.batch_script(where, [*TRAIN, f"hydra.run.dir={run}"], TWO_NODES))
    jobs.wait_until_gone(slurm, job, timeout=180)
    assert summary(run)["status"] == "completed", summary(run)
    return weights(run)


def test_a_time_limit_signal_checkpoints_requeues_and_the_job_resumes_bit_identical(
    slurm, tmp_path, uninterrupted
):
    """sbatch --time=1 --signal=USR1@50: SLURM signals every task 10-40 s into the job; the
    ranks stop after one agreed step with a checkpoint, node 0's runner requeues the job,
    and its next start finds the run (default runs/<timestamp>/) and resumes by itself."""
    options = [*TWO_NODES, "--time=1", "--signal=USR1@50"]
    job = jobs.submit(slurm, jobs.batch_script(tmp_path, TRAIN, options, env=SLOW))
    jobs.wait_until_gone(slurm, job, timeout=300)
    runs = [p for p in (tmp_path / "runs").iterdir()]
    assert len(runs) == 1, runs  # one run directory across the job's starts
    run = runs[0]
    done = summary(run)
    output = (tmp_path / f"job-{job}.out").read_text()
    assert done["status"] == "completed", output
    first = done["history"][0]
    assert first["status"] == "interrupted", done["history"]
    stopped = first["steps"]
    assert 0 < stopped < STEPS
    assert done["resumed_from"] == done["history"][-1]["steps"]
    assert f"stopped after step {stopped} (SIGUSR1)" in output
    assert f"requeued SLURM job {job}" in output
    # every rank, on both nodes, stopped after that same step
    for rank in range(4):
        log = (run / f"logs/rank{rank}.log").read_text()
        assert f"stopped after step {stopped} as asked" in log
    final = weights(run)
    assert all(torch.equal(final[k], uninterrupted[k]) for k in uninterrupted)
    assert jobs.accounted_states(slurm, job)[-1] == "COMPLETED"


def test_scontrol_requeue_stops_the_job_and_its_next_start_resumes_bit_identical(
    slurm, tmp_path, uninterrupted
):
    """A requeue (what PreemptMode=REQUEUE does): SIGTERM to every process, the job starts
    again and goes on from the latest checkpoint by itself."""
    run = tmp_path / "run"
    script = jobs.batch_script(tmp_path, [*TRAIN, f"hydra.run.dir={run}"], TWO_NODES, env=SLOW)
    job = jobs.submit(slurm, script)
    first_checkpoint = run / "checkpoints" / "step_00000040"
    jobs.wait_for("the first checkpoint", first_checkpoint.is_dir, timeout=120)
    requeue = jobs.run(slurm, "scontrol", "requeue", job)
    assert requeue.returncode == 0, requeue.stderr
    jobs.wait_until_gone(slurm, job, timeout=240)
    done = summary(run)
    assert done["status"] == "completed", (tmp_path / f"job-{job}.out").read_text()
    assert done["history"][0]["status"] == "interrupted"
    assert done["resumed_from"] is not None and done["resumed_from"] >= 40
    final = weights(run)
    assert all(torch.equal(final[k], uninterrupted[k]) for k in uninterrupted)


def test_scancel_ends_every_rank_on_both_nodes_and_the_run_is_interrupted(slurm, tmp_path):
    run = tmp_path / "run"
    script = jobs.batch_script(tmp_path, [*TRAIN, f"hydra.run.dir={run}"], TWO_NODES, env=SLOW)
    job = jobs.submit(slurm, script)
    logs = [run / "logs" / f"rank{r}.log" for r in range(4)]

    def training() -> bool:
        return all(log.exists() and "process group" in log.read_text() for log in logs)

    jobs.wait_for("all 4 ranks training", training, timeout=120)
    assert len(jobs.processes_with("runner.train.worker")) == 4
    cancel = jobs.run(slurm, "scancel", job)
    assert cancel.returncode == 0, cancel.stderr
    jobs.wait_until_gone(slurm, job, timeout=60)
    assert summary(run)["status"] == "interrupted", (tmp_path / f"job-{job}.out").read_text()
    leftovers = [p for m in ("runner.train.worker", "runner.launch.agent", str(run))
                 for p in jobs.processes_with(m)]  # fmt: skip
    assert leftovers == []
    assert jobs.accounted_states(slurm, job)[-1] == "CANCELLED"


def test_a_signalled_submitit_job_stops_submitit_requeues_it_and_it_resumes_bit_identical(
    slurm, tmp_path, uninterrupted
):
    """The submitit launcher's job gets SIGUSR2 (what SLURM sends it before its time limit,
    or at preemption): runner stops every rank with a checkpoint, then hands over to
    submitit's handler, which requeues the job; `runner -m` returns when it completed."""
    sweep = tmp_path / "sweep"
    launcher = subprocess.Popen(
        runner_command(
            *(o for o in SUBMITIT_2_NODES if o != "nodes=auto"),  # TRAIN has it
            "hydra.launcher.max_num_timeout=2",  # submitit counts a signal this early as one
            *TRAIN,
            f"hydra.sweep.dir={sweep}",
        ),
        cwd=tmp_path,
        env={**jobs.env_for(slurm), "RUNNER_TEST_STEP_DELAY_S": "0.25"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run = sweep / "0"
    jobs.wait_for("the first checkpoint", (run / "checkpoints" / "step_00000040").is_dir, 120)
    job = jobs.run(slurm, "squeue", "-h", "-o", "%i").stdout.split()[0]
    signal = jobs.run(slurm, "scancel", "--signal=USR2", job)
    assert signal.returncode == 0, signal.stderr
    output, _ = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, output
    done = summary(run)
    assert done["status"] == "completed", output
    assert done["history"][0]["status"] == "interrupted"
    assert done["resumed_from"] == done["history"][0]["steps"] >= 40
    assert ",completed," in (sweep / "sweep.csv").read_text()
    final = weights(run)
    assert all(torch.equal(final[k], uninterrupted[k]) for k in uninterrupted)
