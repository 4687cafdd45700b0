"""grad_accum=auto: out-of-memory errors halve the microbatch, and the weights stay those
of plain PyTorch on whole global batches (tests/test_equivalence.py's and
tests/test_lm_equivalence.py's references), as for any fixed split.

Out of memory is real torch.OutOfMemoryError, raised by `chaos.action=oom` in one rank's
forward pass (in the model's first block) while the microbatch is larger than
`chaos.oom_above`; the other rank has to notice it and drop its own pass with it. On real
2-rank gloo runs of ddp, zero2 and fsdp (the gpt, whose forward pass gathers each block's
weights, so the other rank meets the agreement at the next block's gather).
"""

from __future__ import annotations

import pytest
import torch

from runner.train.step.batch_parts import batch_size
from tests.helpers.cli import HANG
from tests.helpers.equivalence import ARGS, RTOL, relative_error
from tests.helpers.language_model import lm_args

pytestmark = pytest.mark.slow

# Global batch 84 on 2 ranks: 42 samples per rank. Rank 1 runs out of memory from step 3 on
# while a microbatch holds more than 11: 42 -> 21 -> 11 samples, grad_accum 1 -> 2 -> 4
# (microbatches of 11, 11, 10, 10: a split no fixed grad_accum gives, as 84 is not a
# multiple of 2 x 4; plain PyTorch on whole batches is the reference). Step 18 (10
# samples) cuts 5 per rank into 2, 1, 1, 1.
OOM = ["chaos.kill_rank=1", "chaos.at_step=3", "chaos.action=oom", "chaos.oom_above=11"]


def weights(run) -> dict[str, torch.Tensor]:
    return torch.load(run.run_dir / "model.pt", weights_only=True)


def check_settled(run, micro: int, accum: int) -> None:
    assert run.returncode == 0, run.output
    summary = run.summary()
    assert summary["status"] == "completed"
    assert (summary["micro_batch_size"], summary["grad_accum"]) == (micro, accum)
    retries = summary["microbatch_retries"]
    assert retries[-1]["micro_batch_size"] == micro
    assert {r["step"] for r in retries} == {3} and all(r["ranks"] == [1] for r in retries)
    assert "ran out of memory at step 3" in run.rank_log(0)  # rank 0 heard of it


def test_ddp_settles_resumes_at_the_settled_microbatch_and_gives_up_at_one_sample(
    cli,
    mlp_reference,  # noqa: F811
):
    auto = cli(*ARGS, "checkpoint.interval=5", "grad_accum=auto", *OOM, name="run")
    check_settled(auto, micro=11, accum=4)
    # single_auto_sync: the dropped pass synced on rank 0 (it finished it), not on rank 1
    assert relative_error(weights(auto), mlp_reference) < RTOL

    more = cli(*ARGS, "max_steps=22", "grad_accum=auto", "resume=auto", name="run")
    assert more.returncode == 0, more.output
    assert "starting at grad_accum=4" in more.rank_log(0)
    assert more.summary()["grad_accum"] == 4 and more.summary()["microbatch_retries"] == []

    # Every microbatch too large: 42 -> ... -> 1 sample, then a clear failure.
    hopeless = cli(*ARGS, "grad_accum=auto", *OOM[:3], "chaos.oom_above=0", name="none")
    assert hopeless.returncode != 0
    assert "with a microbatch of 1 sample; the model does not fit" in hopeless.output
    assert hopeless.summary()["status"] == "failed"


def test_zero2_goes_on_from_the_microbatch_that_ran_out(cli, mlp_reference):  # noqa: F811
    auto = cli(*ARGS, "parallelism=zero2", "grad_accum=auto", *OOM, name="auto")
    check_settled(auto, micro=11, accum=4)
    assert relative_error(weights(auto), mlp_reference) < RTOL


def test_fsdp_gpt_ranks_stopped_in_different_blocks_agree(cli, corpus, lm_reference):
    # 6 samples per rank: 6 -> 3 -> 2 (cut 2, 2, 1, 1)
    oom = [*OOM[:3], "chaos.oom_above=2"]
    auto = cli(*lm_args(corpus), "parallelism=fsdp", "grad_accum=auto", *oom, timeout=HANG)
    check_settled(auto, micro=2, accum=4)
    assert "stopped: rank(s) [1] ran out of memory" in auto.rank_log(0)  # at block 1's gather
    assert relative_error(weights(auto), lm_reference) < RTOL


BACKWARD_OOM = ["model=custom", "model._target_=tests.helpers.oom_models.BackwardOom"]


def test_a_backward_pass_that_runs_out_is_retried_where_it_exchanges_nothing(
    cli,
    mlp_reference,  # noqa: F811
):
    """ddp with forced_sync exchanges nothing in its backward passes, so rank 1's backward
    pass running out of memory is retried like a forward pass (the model is the mlp, whose
    backward raises while a microbatch holds more than 11 samples); zero2's backward pass
    exchanges gradients, so there it ends the run, promptly, naming the rank and the error."""
    mlp_args = [a for a in ARGS if a != "model=mlp"]
    forced = ["sync_strategy=forced_sync", "grad_accum=auto", "+model.above=11"]
    auto = cli(*BACKWARD_OOM, *mlp_args, *forced, name="auto")
    assert auto.returncode == 0, auto.output
    assert (auto.summary()["micro_batch_size"], auto.summary()["grad_accum"]) == (11, 4)
    assert "out of memory: backward pass ran out of memory" in auto.rank_log(1)
    as_mlp = {k.removeprefix("net."): v for k, v in weights(auto).items()}  # one level down
    assert relative_error(as_mlp, mlp_reference) < RTOL

    zero2 = cli(*BACKWARD_OOM, *mlp_args, "grad_accum=auto", "parallelism=zero2",
                name="zero2", timeout=HANG)  # fmt: skip
    assert zero2.returncode != 0
    error = zero2.summary()["error"]
    assert error["rank"] == 1 and "OutOfMemoryError" in error["message"], error


def test_cutting_a_batch_keeps_the_sampler_split_and_fills_empty_parts():
    # imported here: the module brings torch._dynamo (the MoE layer's compiler.disable), which
    # every worker of the suite would import to collect this file
    from runner.train.step.microbatching import cut_batch, slice_batch

    batch = {"x": torch.arange(10).view(5, 2), "labels": torch.arange(5), "names": list("abcde")}
    assert batch_size(batch) == 5
    assert batch_size((["a", "b"], {"x": torch.zeros(2, 3)})) == 2
    with pytest.raises(ValueError, match="needs a tensor with the samples first"):
        batch_size((["a", "b"], 3))
    piece = slice_batch(batch, 1, 3, 5)
    assert piece["x"].tolist() == [[2, 3], [4, 5]] and piece["names"] == ["b", "c"]
    cut = cut_batch(batch, True, 0, 5, 4)
    assert [(a, b, real) for _, real, a, b in cut] == [
        (0, 2, True), (2, 3, True), (3, 4, True), (4, 5, True)
    ]  # fmt: skip
    # A rank with 2 samples cut into 3: the third part is a placeholder that counts nothing.
    cut = cut_batch(batch, True, 3, 5, 3)
    assert [real for _, real, _, _ in cut] == [True, True, False]
    assert cut[2][0]["labels"].tolist() == [0]
