"""compile: torch.compile (inductor, real C++ kernels on CPU) trains the weights eager
training does, up to the float rounding of reordered sums, on real 2-rank gloo runs: the
whole mlp under DDP (dynamo's DDP optimizer), and the gpt block by block after activation
checkpointing and before FSDP shards it (AOTAutograd's graphs run eagerly in make test,
inductor's kernels in make test-matrix), and after tensor parallelism split it. Eager is
plain PyTorch on whole global batches (the equivalence tests' references, which every eager
split matches within 1e-7).
model.pt keeps eager's keys.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runner.spec.schema import CompileSpec
from runner.train.build.compiling import blocks_to_compile
from tests.helpers.cli import HANG, MATRIX
from tests.helpers.equivalence import ARGS, relative_error
from tests.helpers.language_model import lm_args

pytestmark = pytest.mark.slow

# Measured when written: 3e-8 (mlp, ddp) and 2e-7 (gpt, fsdp; zero2, zero3 and ddp alike)
# relative to the weights' norm, against eager runner runs.
RTOL = 1e-5


def check_compiled(cli, overrides: list[str], compiled_as: str, eager: dict) -> None:
    chosen = [] if any(o.startswith("compile=") for o in overrides) else ["compile=true"]
    compiled = cli(*overrides, *chosen, name="compiled", timeout=HANG)
    assert compiled.returncode == 0, compiled.output
    assert f"compile: {compiled_as}" in compiled.rank_log(0)
    assert compiled.summary()["compile_s"] > 0
    weights = torch.load(compiled.run_dir / "model.pt", weights_only=True)
    assert list(weights) == list(eager)  # compiled in place: no _orig_mod. prefixes
    assert relative_error(weights, eager) < RTOL


@pytest.mark.floor
def test_whole_model_under_ddp(cli, mlp_reference):  # noqa: F811
    check_compiled(cli, ARGS, "the whole Sequential compiled", mlp_reference)


@pytest.mark.parametrize(
    "memory",
    # make test compiles the blocks by AOTAutograd's graphs run eagerly (aot_eager: the same
    # capture, checkpointing and FSDP hooks, no C++ to build: 14 CPU-seconds where inductor
    # took 58); inductor's own kernels are the whole mlp's, above, and the matrix's here
    [pytest.param(["activation_checkpointing=full", "compile={backend:aot_eager}"], id="full"),
     pytest.param(["activation_checkpointing=full"], id="full-inductor", marks=MATRIX),
     pytest.param(["activation_memory_budget=0.5"], id="budget", marks=MATRIX),
     pytest.param(["activation_checkpointing=selective", "nproc=2", "parallelism.tensor=2"],
                  id="selective-tp2", marks=MATRIX)],
)  # fmt: skip
def test_gpt_blocks_after_checkpointing_before_fsdp(cli, corpus, lm_reference, memory):
    """Each block compiled after checkpointing wrapped it and before FSDP shards it; in the
    last case after the tensor-parallel plan split it too (DTensor, the sequence's gathers
    and scatters inside the graph), with selective checkpointing."""
    gpt = [*lm_args(corpus), "parallelism=fsdp", *memory]
    check_compiled(cli, gpt, "2 blocks (Block) compiled one by one", lm_reference)


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


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        ((), None),
        (("grad_accum=auto",), "grad_accum=auto recuts microbatches"),
        (("parallelism=fsdp",), "not under parallelism=fsdp"),
        (("parallelism=zero2",), "not under parallelism=zero2"),
        (("data=text", "data.root=/tmp", "data.min_length=16"), "data.min_length=16 makes"),
        (("nonfinite=skip",), "nonfinite=skip reads every step's verdict on the host"),
    ],
)
def test_what_cuda_graphs_cannot_capture_is_refused(overrides, problem) -> None:
    """compile.mode=reduce-overhead as preflight checks it where one GPU is visible, and on
    this CPU."""
    from runner.spec import resolve_spec
    from runner.spec.convert import SpecError
    from tests.helpers.config import compose_config

    graphs = ["model=gpt", "compile={mode:reduce-overhead}", *overrides]
    gpu = compose_config(["device=cuda", "nproc=1", *graphs])
    if problem is None:
        assert resolve_spec(gpu, cuda_devices=1).compile.captures_graphs
    else:
        with pytest.raises(SpecError, match=problem):
            resolve_spec(gpu, cuda_devices=1)
    with pytest.raises(SpecError, match="captures CUDA graphs, which need device=cuda"):
        resolve_spec(compose_config(["device=cpu", *graphs]))
    assert not CompileSpec(mode="max-autotune-no-cudagraphs").captures_graphs
