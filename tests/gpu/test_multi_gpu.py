"""Several GPUs on one machine: NCCL across ranks, and HSDP's 2-D mesh. Written by the
documentation (torch's NCCL process group, FSDP2's `mesh` with a replicate dimension,
DeepSpeed's ZeRO over NCCL) and **unverified**: no machine with more than one GPU has run
them yet. Skipped where fewer GPUs are visible than a test needs."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.cli import FAST
from tests.helpers.gpu_runs import check_trained, load_on_cpu

pytestmark = pytest.mark.multi_gpu

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
MULTI = ["device=cuda", "max_epochs=null", "max_steps=20", "log_interval=5", "precision=bf16"]


@pytest.mark.skipif(GPUS < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("parallelism", ["ddp", "zero2", "zero3", "fsdp"])
def test_two_ranks_over_nccl(cli, parallelism):
    run = cli(*FAST, *MULTI, "nproc=2", f"parallelism={parallelism}")
    summary = check_trained(run)
    assert summary["world_size"] == 2
    load_on_cpu(run)


@pytest.mark.skipif(GPUS < 4, reason="needs 4 GPUs")
def test_hsdp_two_copies_each_sharded_over_two_gpus(cli):
    run = cli(*FAST, *MULTI, "nproc=4", "parallelism=fsdp", "parallelism.replicate=2")
    check_trained(run)
    assert "HSDP: 2 copies, each sharded over 2 ranks" in run.rank_log(0)
    load_on_cpu(run)
