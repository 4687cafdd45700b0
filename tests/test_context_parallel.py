"""Context parallelism (parallelism.context): each rank of a context group computes its
load-balanced part of every sequence, attending to the keys and values its group gathers;
the gpt trains the weights ddp trains, beside FSDP's sharding and tensor parallelism, on
ragged samples whose length the group does not divide (padded inside the model).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runner.models.context_split import ContextSplit
from tests.helpers.cli import MATRIX
from tests.helpers.config import compose_config
from tests.helpers.equivalence import relative_error
from tests.helpers.language_model import lm_args
from tests.helpers.refusals import refused
from tests.helpers.shared_runs import SharedRuns

RTOL = 1e-5


@pytest.fixture(scope="module")
def cp_run(tmp_path_factory, corpus: Path) -> SharedRuns:
    """`cp_run(*overrides)`: one run of the module's gpt with these overrides, made once."""
    args = [*lm_args(corpus), "model.n_layer=2", "grad_clip_norm=0.5"]
    return SharedRuns(tmp_path_factory.mktemp("context_runs"), args)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("layout", "data_ranks"),
    [
        pytest.param(("nproc=2", "grad_accum=2"), 1, id="context2"),
        pytest.param(  # compiled blocks: make test's in tests/test_compile.py, test_pipeline.py
            ("nproc=2", "grad_accum=2", "compile={backend:aot_eager}"),
            1,
            id="context2-compiled",
            marks=MATRIX,
        ),
        pytest.param(
            ("nproc=2", "grad_accum=2", "compile=true"), 1, id="context2-inductor", marks=MATRIX
        ),
        pytest.param(("nproc=4", "grad_accum=2", "parallelism.tensor=2"), 1, id="context2-tensor2"),
        pytest.param(("nproc=4", "grad_accum=1"), 2, id="shard2-context2", marks=MATRIX),
        pytest.param(
            ("nproc=4", "grad_accum=1", "parallelism.replicate=2"),
            2,
            id="hsdp2-context2",
            marks=MATRIX,
        ),
    ],
)
def test_context_parallelism_trains_what_ddp_trains(cp_run, layout, data_ranks: int) -> None:
    """The same weights, losses, clipped gradient norms, validation loss and perplexity as
    ddp over the data ranks alone; tokens/s counts every token of the batch once (the same
    tokens per sample as that ddp run's, whose microbatches are padded alike)."""
    accum = next(o for o in layout if o.startswith("grad_accum="))
    reference = cp_run(f"nproc={data_ranks}", "parallelism=ddp", accum)
    result = cp_run("parallelism=fsdp", "parallelism.context=2", *layout)
    weights = torch.load(result.run_dir / "model.pt", weights_only=True)
    expected = torch.load(reference.run_dir / "model.pt", weights_only=True)
    assert relative_error(weights, expected) <= RTOL
    final, theirs = result.summary()["final"], reference.summary()["final"]
    for key in ("val/loss", "val/perplexity"):
        assert final[key] == pytest.approx(theirs[key], rel=RTOL)
    for mine, other in zip(result.metrics(), reference.metrics(), strict=True):
        assert mine["train/loss"] == pytest.approx(other["train/loss"], rel=RTOL)
        assert mine["train/grad_norm"] == pytest.approx(other["train/grad_norm"], rel=1e-4)
        per_sample = mine["throughput/tokens_per_sec"] / mine["throughput/samples_per_sec"]
        expected_per_sample = (
            other["throughput/tokens_per_sec"] / other["throughput/samples_per_sec"]
        )
        assert per_sample == pytest.approx(expected_per_sample, rel=1e-3)


def test_each_rank_takes_a_head_and_a_tail_of_the_sequence() -> None:
    """Causal attention's work balanced: of 8 positions in 4 chunks, rank 0 computes the
    first and last chunk, rank 1 the middle two; a next-token loss reads, for each of a
    rank's positions, the token after it (none after the last)."""
    split = ContextSplit(group=None, rank=0, size=2)
    assert split.owned(0, 8, "cpu").tolist() == [0, 1, 6, 7]
    assert split.owned(1, 8, "cpu").tolist() == [2, 3, 4, 5]
    assert split.multiple == 4  # 10 positions are padded to 12
    split.prepare(8, "cpu")  # gathered as rank 0's [0, 1, 6, 7], rank 1's [2, 3, 4, 5]
    assert split.inverse.tolist() == [0, 1, 4, 5, 6, 7, 2, 3]
    targets = torch.arange(10, 17)[None]  # 7 tokens: padded to 8 with the ignore index
    logits, laid_out = split.local(torch.zeros(1, 4, 3), targets)
    assert logits.shape == (1, 5, 3)
    assert laid_out.tolist() == [[-100, 11, 12, -100, -100]]  # after 0, 1, 6 (16 is last), 7
    assert split.tokens(laid_out) == 3  # positions 0, 1, 6 of the 7 tokens; 7 is padding


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (
            ("nproc=3", "parallelism.context=2"),
            "parallelism.context=2: groups of equal size must divide the world size",
        ),
        (
            ("nproc=2", "parallelism.context=2", "loss=cross_entropy"),
            "parallelism.context=2: loss._target_=runner.train.losses.CrossEntropy cannot be split",
        ),
        (
            ("nproc=4", "parallelism.context=2", "parallelism.pipeline=2", "grad_accum=2"),
            "parallelism.context=2: not with parallelism.pipeline yet",
        ),
    ],
)
def test_a_context_split_that_cannot_run_is_refused(overrides, problem: str) -> None:
    from runner.spec import resolve_spec
    from runner.spec.convert import SpecError

    config = compose_config(
        ["parallelism=fsdp", "model=gpt", "loss=causal_lm", "device=cpu", *overrides]
    )
    with pytest.raises(SpecError) as refused:
        resolve_spec(config)
    assert problem in str(refused.value)


def test_a_model_runner_cannot_split_by_position_is_refused_before_launch() -> None:
    found = refused(
        "model=mlp", "data=digits", "loss=causal_lm", "nproc=2", "parallelism=fsdp",
        "parallelism.context=2",
    )  # fmt: skip
    assert "parallelism.context=2: runner cannot split Sequential's attention" in found
