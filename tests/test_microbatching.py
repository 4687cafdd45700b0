"""grad_accum=auto: out-of-memory errors halve the microbatch, and the weights stay those of
a run that used the final microbatch from the start.

Out of memory is real torch.OutOfMemoryError, raised by `chaos.action=oom` in one rank's
forward pass (in the model's last block) while the microbatch is larger than
`chaos.oom_above`; the other rank has to notice it and drop its own pass with it. On real
2-rank gloo runs of ddp, zero2 and fsdp (the gpt, whose forward pass gathers each block's
weights on every rank, so the ranks stop in different places).
"""

from __future__ import annotations

import json

import pytest
import torch

from runner.train.microbatching import batch_size, cut_batch, slice_batch
from tests.conftest import FAST, run_cli
from tests.test_equivalence import relative_error
from tests.test_lm_equivalence import corpus, lm_args  # noqa: F401  (the corpus fixture)

pytestmark = pytest.mark.slow

RTOL = 1e-5
STEPS = ["max_epochs=null", "max_steps=6", "log_interval=2", "global_batch_size=64"]
# Rank 1 runs out of memory from step 3 on while a microbatch holds more than 8 samples:
# 32 -> 16 -> 8 samples per microbatch, grad_accum 1 -> 2 -> 4.
OOM = ["chaos.kill_rank=1", "chaos.at_step=3", "chaos.action=oom", "chaos.oom_above=8"]


def weights(run) -> dict[str, torch.Tensor]:
    return torch.load(run.run_dir / "model.pt", weights_only=True)


def check_settled(run, micro: int, accum: int, oom_step: int = 3) -> None:
    assert run.returncode == 0, run.output
    summary = run.summary()
    assert summary["status"] == "completed"
    assert (summary["micro_batch_size"], summary["grad_accum"]) == (micro, accum)
    retries = summary["microbatch_retries"]
    assert [r["micro_batch_size"] for r in retries][-1] == micro
    assert {r["step"] for r in retries} == {oom_step} and all(r["ranks"] == [1] for r in retries)
    assert "ran out of memory at step 3" in run.rank_log(0)  # rank 0 heard of it


@pytest.fixture(scope="module")
def fixed_ddp(tmp_path_factory):
    """The mlp on ddp with grad_accum=4 from the start: what the ddp runs must end at."""
    run = run_cli(tmp_path_factory.mktemp("fixed"), *FAST, *STEPS, "grad_accum=4", name="fixed")
    assert run.returncode == 0, run.output
    return weights(run)


def test_ddp_settles_resumes_at_the_settled_microbatch_and_gives_up_at_one_sample(cli, fixed_ddp):
    auto = cli(*FAST, *STEPS, "checkpoint.interval=2", "grad_accum=auto", *OOM, name="run")
    check_settled(auto, micro=8, accum=4)
    # single_auto_sync: the dropped pass synced on rank 0 (it finished it), not on rank 1
    assert relative_error(weights(auto), fixed_ddp) < RTOL
    record = json.loads((auto.run_dir / "microbatching.json").read_text())
    assert record["grad_accum"] == 4

    more = cli(*FAST, *STEPS[:1], "max_steps=8", "global_batch_size=64", "grad_accum=auto",
               "resume=auto", name="run")  # fmt: skip
    assert more.returncode == 0, more.output
    assert "starting at grad_accum=4" in more.rank_log(0)
    assert more.summary()["grad_accum"] == 4 and more.summary()["microbatch_retries"] == []

    # Every microbatch too large: 32 -> ... -> 1 sample, then a clear failure.
    hopeless = cli(*FAST, *STEPS, "grad_accum=auto", *OOM[:3], "chaos.oom_above=0", name="none")
    assert hopeless.returncode != 0
    assert "with a microbatch of 1 sample; the model does not fit" in hopeless.output
    assert hopeless.summary()["status"] == "failed"


def test_zero2_goes_on_from_the_microbatch_that_ran_out(cli, fixed_ddp):
    """Against ddp's run with the final microbatch: every engine trains the same weights
    (tests/test_equivalence.py), so that is zero2's too."""
    auto = cli(*FAST, *STEPS, "parallelism=zero2", "grad_accum=auto", *OOM, name="auto")
    check_settled(auto, micro=8, accum=4)
    assert relative_error(weights(auto), fixed_ddp) < RTOL


def test_fsdp_gpt_ranks_stopped_in_different_blocks_agree(cli, corpus):  # noqa: F811
    gpt = [*lm_args(corpus), "model.n_layer=3", "global_batch_size=16", "parallelism=fsdp"]
    oom = [*OOM[:3], "chaos.oom_above=2"]  # 8 -> 4 -> 2 samples
    auto = cli(*gpt, "grad_accum=auto", *oom, name="auto", timeout=120)
    check_settled(auto, micro=2, accum=4)
    fixed = cli(*gpt, "grad_accum=4", name="fixed")
    assert fixed.returncode == 0, fixed.output
    assert relative_error(weights(auto), weights(fixed)) < RTOL


BACKWARD_OOM = ["model=custom", "model._target_=tests.oom_models.BackwardOom"]


def test_a_backward_pass_that_runs_out_is_retried_where_it_exchanges_nothing(cli, fixed_ddp):
    """ddp with forced_sync exchanges nothing in its backward passes, so rank 1's backward
    pass running out of memory is retried like a forward pass (the model is the mlp, whose
    backward raises while a microbatch holds more than 8 samples); zero2's backward pass
    exchanges gradients, so there it ends the run, promptly, naming the rank and the error."""
    forced = ["sync_strategy=forced_sync"]
    auto = cli(*BACKWARD_OOM, *FAST[1:], *STEPS, *forced, "grad_accum=auto", name="auto")
    assert auto.returncode == 0, auto.output
    assert (auto.summary()["micro_batch_size"], auto.summary()["grad_accum"]) == (8, 4)
    assert "out of memory: backward pass ran out of memory" in auto.rank_log(1)
    as_mlp = {k.removeprefix("net."): v for k, v in weights(auto).items()}  # one level down
    assert relative_error(as_mlp, fixed_ddp) < RTOL

    zero2 = cli(*BACKWARD_OOM, *FAST[1:], *STEPS, "grad_accum=auto", "parallelism=zero2",
                name="zero2", timeout=120)  # fmt: skip
    assert zero2.returncode != 0
    error = zero2.summary()["error"]
    assert error["rank"] == 1 and "OutOfMemoryError" in error["message"], error


def test_cutting_a_batch_keeps_the_sampler_split_and_fills_empty_parts():
    batch = {"x": torch.arange(10).view(5, 2), "labels": torch.arange(5), "names": list("abcde")}
    assert batch_size(batch) == 5
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
