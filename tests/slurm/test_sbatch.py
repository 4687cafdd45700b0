"""runner through a real SLURM cluster: 2 nodes (network namespaces) x 2 ranks."""

from __future__ import annotations

import json

import torch

from tests.helpers.equivalence import relative_error
from tests.slurm import jobs
from tests.slurm.jobs import SUBMITIT_2_NODES, TRAIN, runner

# SLURM's and Ray's processes as they start them: no warm server (tests/helpers/warm.py)
COLD_START = True

RTOL = 1e-5


def test_submitit_slurm_on_two_nodes_trains_what_four_local_ranks_do(slurm, tmp_path):
    """docs/multi-node.md's submitit_slurm example: one task per node, nodes=auto, 2 ranks
    each."""
    sweep = tmp_path / "sweep"
    done = runner(
        tmp_path,
        slurm,
        *SUBMITIT_2_NODES,
        "nproc=2",
        *TRAIN,
        f"hydra.sweep.dir={sweep}",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    run = sweep / "0"
    assert (run / "node1").is_dir()  # node 1's own files, one run directory
    local = runner(tmp_path, slurm, "nproc=4", *TRAIN, f"hydra.run.dir={tmp_path / 'local'}")
    assert local.returncode == 0, local.stdout + local.stderr
    a = torch.load(run / "model.pt", weights_only=True)
    b = torch.load(tmp_path / "local" / "model.pt", weights_only=True)
    assert relative_error(a, b) < RTOL


def test_a_sweep_is_one_slurm_job_per_point_with_its_table(slurm, tmp_path):
    sweep = tmp_path / "sweep"
    done = runner(
        tmp_path,
        slurm,
        *SUBMITIT_2_NODES,
        "nproc=1",
        *TRAIN,
        "seed=1,2",
        f"hydra.sweep.dir={sweep}",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = (sweep / "sweep.csv").read_text().splitlines()
    assert len(rows) == 3 and all(",completed," in row for row in rows[1:]), rows
    assert "seed=1" in rows[1] and "seed=2" in rows[2]
    # submitit submits the sweep as one job array: a task per point, <array>_0 and <array>_1,
    # each an allocation of its own 2 nodes with a runner on each (docs/multi-node.md)
    tasks = [p.name for p in (sweep / ".submitit").iterdir() if p.is_dir() and "_" in p.name]
    assert len(tasks) == 2, tasks
    for job in ("0", "1"):
        summary = json.loads((sweep / job / "summary.json").read_text())
        assert summary["world_size"] == 2 and (sweep / job / "node1").is_dir(), summary


def test_a_failing_rank_on_node_2_fails_the_job_naming_rank_and_host(slurm, tmp_path):
    """sbatch + srun, one runner per node: rank 3 (node2's second) raises at step 5."""
    run = tmp_path / "run"
    overrides = [
        *TRAIN,
        "nodes=auto",
        "nproc=2",
        "master_port=29613",
        "chaos.kill_rank=3",
        "chaos.at_step=5",
        "chaos.action=raise",
        f"hydra.run.dir={run}",
    ]
    script = jobs.batch_script(tmp_path, overrides, ["-N 2", "--ntasks-per-node=1"])
    job = jobs.submit(slurm, script)
    jobs.wait_until_gone(slurm, job, timeout=300)
    error = json.loads((run / "summary.json").read_text())["error"]
    assert (error["rank"], error["host"]) == (3, "node2"), error
    assert "ChaosError" in error["message"]
    assert jobs.accounted_states(slurm, job)[-1] == "FAILED"
