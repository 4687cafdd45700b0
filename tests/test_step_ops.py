"""A step with nothing a plain script does not need: the ATen ops a quiet step of runner
dispatches (a 12-layer gpt, 32 wide, one rank: a step bound by launching ops, not by their
arithmetic), counted by a dispatch mode over steps that log, evaluate and save nothing,
against the loop a user writes by hand around the same model, under ddp and under fsdp."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.helpers.cli import run_cli
from tests.helpers.nodes import free_port
from tests.helpers.op_counts import OpCounts, counted

pytestmark = pytest.mark.slow

LAYERS, WIDTH, HEADS, BLOCK, BATCH, VOCAB = 12, 32, 2, 64, 8, 256
STEPS = 9
QUIET = range(4, STEPS)  # after the first steps' warm-up (5 of them); the last logs and saves
# What runner's step may dispatch beyond the hand-written loop's: the loss counts its items,
# is weighted by the global batch's and summed over the microbatches, the non-finite guard
# notes it; the batch comes from the loader's indexing, not one randint. Measured here
# (2026-11-28): ddp 1956 against 2025 (fewer), fsdp 2288 against 2277 (+11).
MORE_THAN_PLAIN = 16


def gpt_run_args(corpus: Path) -> list[str]:
    return [
        "model=gpt", f"model.n_layer={LAYERS}", f"model.n_embd={WIDTH}",
        f"model.n_head={HEADS}", "data=text", f"data.root={corpus}",
        f"data.block_size={BLOCK}", "loss=causal_lm", "metrics=language_model",
        "precision=fp32", f"global_batch_size={BATCH}", "max_epochs=null",
        f"max_steps={STEPS}", "log_interval=1000", "eval_interval=1000",
        "progress_bar=false", "nproc=1", "logger=[]",
        "callbacks=[{_target_: tests.helpers.op_counts.OpCounter}]",
    ]  # fmt: skip


def plain_step_ops(engine: str, port: int) -> float:
    """The hand-written loop (the loop plain_gpt.py and plain_sharded.py run): runner's gpt
    module, DDP or FSDP2, AdamW, the next-token loss; ops per quiet step (median)."""
    from torch.nn.parallel import DistributedDataParallel

    from runner.models.gpt import GPT

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        module = GPT(VOCAB, BLOCK, LAYERS, HEADS, WIDTH)
        if engine == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for block in module.blocks:
                fully_shard(block)
            model = fully_shard(module)
        else:
            model = DistributedDataParallel(module)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        tokens = torch.randint(0, VOCAB, (100_000,))
        step = 0
        with OpCounts(lambda: step) as mode:
            for step in range(1, STEPS + 1):  # noqa: B007 (read by the mode)
                starts = torch.randint(len(tokens) - BLOCK, (BATCH, 1))
                x = tokens[starts + torch.arange(BLOCK)]
                logits = model(x)
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        return statistics.median(mode.counts[s] for s in QUIET)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_a_quiet_step_dispatches_no_more_than_the_plain_loops(
    engine: str, corpus: Path, tmp_path: Path
) -> None:
    run = run_cli(tmp_path, *gpt_run_args(corpus), f"parallelism={engine}")
    assert run.returncode == 0, run.output
    alone = "parallelism=fsdp on 1 rank: nothing to shard"  # said, where it is so
    assert (alone in run.output) == (engine == "fsdp"), run.output
    ours = statistics.median(counted(run.run_dir)[s] for s in QUIET)
    plain = plain_step_ops(engine, free_port())
    print(f"{engine}: runner {ours} ops a quiet step, the plain loop {plain}")
    assert ours <= plain + MORE_THAN_PLAIN, (ours, plain)
