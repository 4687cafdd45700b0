"""compile: torch.compile (inductor, real C++ kernels on CPU) trains the weights eager
training does, up to the float rounding of reordered sums, on real 2-rank gloo runs:
the whole mlp under DDP (dynamo's DDP optimizer), and the gpt block by block after
activation checkpointing and before FSDP shards it. model.pt keeps eager's keys.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runner.spec.schema import CompileSpec
from runner.train.compiling import blocks_to_compile
from tests.conftest import FAST
from tests.test_equivalence import relative_error
from tests.test_lm_equivalence import corpus, lm_args  # noqa: F401  (the corpus fixture)

pytestmark = pytest.mark.slow

# Measured when written: 3e-8 (mlp, ddp) and 2e-7 (gpt, fsdp; zero2, zero3 and ddp alike)
# relative to the weights' norm.
RTOL = 1e-5
STEPS = ["max_epochs=null", "max_steps=8", "log_interval=4"]


def compare(cli, overrides: list[str], compiled_as: str) -> None:
    compiled = cli(*overrides, "compile=true", name="compiled", timeout=300)
    assert compiled.returncode == 0, compiled.output
    assert f"compile: {compiled_as}" in compiled.rank_log(0)
    summary = compiled.summary()
    assert summary["compile_s"] > 0
    eager = cli(*overrides, name="eager")
    assert eager.returncode == 0, eager.output
    assert eager.summary()["compile_s"] is None
    a = torch.load(compiled.run_dir / "model.pt", weights_only=True)
    b = torch.load(eager.run_dir / "model.pt", weights_only=True)
    assert list(a) == list(b)  # compiled in place: no _orig_mod. prefixes
    assert relative_error(a, b) < RTOL


def test_whole_model_under_ddp(cli):
    compare(cli, [*FAST, *STEPS], "the whole Sequential compiled")


def test_gpt_blocks_after_checkpointing_before_fsdp(cli, corpus):  # noqa: F811
    gpt = [*lm_args(corpus), *STEPS, "parallelism=fsdp", "activation_checkpointing=full"]
    compare(cli, gpt, "2 blocks (Block) compiled one by one")


class Net(nn.Module):
    def __init__(self, blocks: int, width: int, head: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(blocks))
        self.head = nn.Linear(width, head)


def test_per_block_is_the_default_where_the_blocks_hold_most_weights():
    auto, on, off = CompileSpec(), CompileSpec(per_block=True), CompileSpec(per_block=False)
    deep = Net(blocks=4, width=16, head=16)  # blocks: 4/5 of the weights
    assert len(blocks_to_compile(deep, auto)) == 4
    assert blocks_to_compile(deep, off) == []
    wide_head = Net(blocks=2, width=4, head=400)  # the head dominates: the whole model
    assert blocks_to_compile(wide_head, auto) == []
    assert len(blocks_to_compile(wide_head, on)) == 2
    with pytest.raises(ValueError, match="compile.per_block=true: Sequential has no blocks"):
        blocks_to_compile(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), on)
