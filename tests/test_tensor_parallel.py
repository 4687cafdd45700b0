"""Tensor parallelism on the (replicate, shard, tensor) mesh, on CPU with gloo: runner's gpt
split by its plan trains the weights plain single-process PyTorch trains, within 1e-5
(fp32), alone (TP=4), under FSDP2 (FSDP2 x TP2) and HSDP (2 copies x TP2), at one and three
microbatches; gradient clipping and the logged gradient norm see every shard once; a
checkpoint written at FSDP2 x TP2 goes on at FSDP4, at TP4 and at ddp; init_from, async
checkpoints, runner export and the non-finite guard hold under it; a gpt whose sizes the group
does not divide is refused before any rank starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from runner.spec import RunSpec, resolve_spec
from runner.spec.mesh import Layout
from tests.helpers.cli import MATRIX, run_cli
from tests.helpers.config import compose_config
from tests.helpers.equivalence import ARGS, relative_error
from tests.helpers.hugging_face import llama_args, text_corpus
from tests.helpers.language_model import lm_args, train_plain
from tests.helpers.ranks import start_ranks
from tests.helpers.refusals import refused
from tests.helpers.weights import assert_exports_model_pt, max_relative_difference

RTOL = 1e-5
# Four heads, split four ways. At four heads some of the last MLP's gradients are so near
# zero that AdamW's default eps (1e-8) turns their rounding into updates of lr's size: plain
# FSDP is off by 2e-5 there; with eps=1e-6 every split agrees within 1e-6.
FOUR_HEADS = ["model.n_head=4", "optimizer.eps=1e-6"]


def test_a_tensor_group_is_consecutive_ranks_reading_one_batch() -> None:
    grid = Layout(replicate=2, shard=2, tensor=2)
    assert (grid.world, grid.data_world) == (8, 4)
    assert [grid.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [grid.tensor_rank(r) for r in range(8)] == [0, 1] * 4


def test_the_batch_splits_over_the_data_ranks_only() -> None:
    spec = resolve_spec(compose_config([
        "parallelism=fsdp", "parallelism.tensor=2", "nproc=4", "global_batch_size=8",
        "device=cpu",
    ]))  # fmt: skip
    assert (spec.world_size, spec.data_world_size, spec.per_rank_batch_size) == (4, 2, 4)


def split_head(rank: int, init_file: str, out: str) -> None:
    """Rank `rank` of 2: the gpt split by its plan, its logits left split by vocabulary and
    gathered, on an odd sequence (split unevenly); the loss and gradients of each."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from runner.engines.loss_parallel import loss_of, split_by_class, split_loss
    from runner.models.families.gpt import gpt_plan
    from runner.models.gpt import GPT
    from runner.train.losses import CausalLM, CrossEntropy

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    tokens = torch.randint(0, 64, (2, 15), generator=torch.Generator().manual_seed(0))
    targets = tokens.clone()
    targets[0, 3] = -100  # an ignored token
    results = {}
    for split in (False, True):
        torch.manual_seed(0)
        model = GPT(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=16)
        gpt_plan(model, mesh, split_logits=split)
        with split_loss():  # as the engine runs a training microbatch
            logits = model(tokens)
            loss, _ = loss_of(CausalLM(), logits, targets)
            loss.backward()
        assert split_by_class(logits) is split
        assert logits.shape[:2] == tokens.shape  # padded to 16 inside, cut back to 15
        assert not isinstance(loss, DTensor)
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        results[split] = (loss.detach(), grads)
        if split:  # a loss that cannot run on split logits gets them gathered
            smoothed, _ = loss_of(CrossEntropy(label_smoothing=0.1), logits[:, 0], tokens[:, 1])
            assert not isinstance(smoothed, DTensor)
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()
    os._exit(0)  # skip gloo's teardown (tests/test_sync_strategies.py)


@pytest.mark.slow
@pytest.mark.floor  # torch 2.11 raised on an unevenly split sequence
def test_the_loss_runs_on_logits_split_by_vocabulary(tmp_path: Path) -> None:
    """Loss parallel: the gpt's logits stay split across the tensor group and the loss (an
    ignored token included) and every gradient equal those of gathered logits, on a
    sequence the group does not divide (the gpt pads it to a multiple of the group; an
    uneven split raised in torch 2.11's DTensor linear)."""

    out = tmp_path / "results.pt"
    start_ranks(split_head, (str(tmp_path / "init"), str(out)), 2)
    results = torch.load(out, weights_only=True)
    (gathered_loss, gathered), (split_loss, split) = results[False], results[True]
    assert split_loss == pytest.approx(gathered_loss.item(), rel=1e-6)
    assert relative_error(split, gathered) < 1e-6  # rounding only


# Ragged samples of 16 to 24 tokens (odd lengths a tensor group splits unevenly among them):
# every new batch shape costs each rank DTensor's sharding propagation again, and lengths from
# 3 up gave each 4-rank run of these about 5 CPU-seconds more of it, proving nothing more.
RAGGED = ["data.min_length=16"]


@pytest.fixture(scope="module")
def reference(corpus: Path) -> dict[str, torch.Tensor]:
    spec: RunSpec = resolve_spec(
        compose_config([*lm_args(corpus), *RAGGED, *FOUR_HEADS, "nproc=1", "device=cpu"])
    )
    return train_plain(spec)


MESHES = {
    "tp4": ["parallelism.tensor=4"],
    "fsdp2xtp2": ["parallelism.tensor=2"],
    "hsdp2xtp2": ["parallelism.tensor=2", "parallelism.replicate=2"],
    "fsdp2xtp2-selective": ["parallelism.tensor=2", "activation_checkpointing=selective"],
}
# `make test`: a mesh of shards and one of copies beside a tensor group (fsdp2xtp2 as the
# selective one); tp4 trains in make test from a checkpoint (the to-tp4 resume below, to the
# uninterrupted run's weights); the rest are make test-matrix's
IN_MAKE_TEST = {("hsdp2xtp2", 1), ("fsdp2xtp2-selective", 3)}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mesh", "grad_accum"),
    [
        pytest.param(
            mesh, accum, id=f"{name}-{accum}", marks=() if (name, accum) in IN_MAKE_TEST else MATRIX
        )
        for accum in (1, 3)
        for name, mesh in MESHES.items()
    ],
)
def test_tensor_parallel_meshes_train_the_plain_model(
    cli, corpus: Path, reference, mesh: list[str], grad_accum: int
) -> None:
    result = cli(
        *lm_args(corpus), *RAGGED, *FOUR_HEADS, "nproc=4", f"grad_accum={grad_accum}",
        "parallelism=fsdp", *mesh,
    )  # fmt: skip
    assert result.returncode == 0, result.output
    weights = torch.load(result.run_dir / "model.pt", weights_only=True)
    assert relative_error(weights, reference) <= RTOL


def test_a_gpt_the_group_does_not_divide_is_refused(corpus: Path) -> None:
    found = refused(*lm_args(corpus), "nproc=4", "parallelism=fsdp", "parallelism.tensor=4")
    assert (
        "parallelism.tensor=4: must divide model.n_head=2 (the gpt's plan splits it across the "
        "tensor group)"
    ) in found


CLIPPED = ["grad_clip_norm=0.5", "checkpoint.interval=2", "checkpoint.keep=3"]
# Samples of one length for the runs below: ragged batches through each mesh are
# test_tensor_parallel_meshes_train_the_plain_model's (and the lifecycle's `tensor` row), and
# every new shape costs each rank DTensor's sharding propagation again (2 CPU-s a run).
WHOLE_BLOCKS = ["data.min_length=null"]


def tp_args(corpus: Path) -> list[str]:
    return [*lm_args(corpus), *WHOLE_BLOCKS, *FOUR_HEADS]


@pytest.fixture(scope="module")
def ddp_and_tp(tmp_path_factory, corpus: Path) -> dict[str, Any]:
    """The same gpt, its gradients clipped, trained at ddp and at FSDP2 x TP2 on 4 ranks."""
    runs = {}
    meshes = {
        "fsdp2xtp2": ["parallelism=fsdp", "parallelism.tensor=2"],
        "ddp": ["parallelism=ddp"],
    }
    for name, mesh in meshes.items():
        result = run_cli(
            tmp_path_factory.mktemp(name), *tp_args(corpus), *CLIPPED, "nproc=4", *mesh,
            name=name,
        )  # fmt: skip
        assert result.returncode == 0, result.output
        runs[name] = result
    return runs


@pytest.mark.slow
def test_clipping_and_the_gradient_norm_hold_across_the_tensor_group(ddp_and_tp) -> None:
    """The norm over every shard: the same logged grad_norm as ddp's whole gradients, each
    step, and clipped by it to the same weights."""
    whole, tp = ddp_and_tp["ddp"], ddp_and_tp["fsdp2xtp2"]
    norms = {m["step"]: m["train/grad_norm"] for m in whole.metrics()}
    assert max(norms.values()) > 0.5  # clipping changed the steps
    for record in tp.metrics():
        assert record["train/grad_norm"] == pytest.approx(norms[record["step"]], rel=1e-5)
    assert max_relative_difference(tp.run_dir, whole.run_dir) < 1e-5


@pytest.mark.slow
def test_tokens_count_each_batch_once(ddp_and_tp) -> None:
    """The ranks of a tensor group read one batch, and it counts once: tokens per sample in
    each logged interval (tokens/s over samples/s, the same seconds) are a block's (24, as
    at ddp), not T times that, and so MFU divides the batch's tokens by every device."""
    for name in ("ddp", "fsdp2xtp2"):
        for record in ddp_and_tp[name].metrics():
            tokens = record["throughput/tokens_per_sec"] / record["throughput/samples_per_sec"]
            assert tokens == pytest.approx(24, rel=1e-3), (name, record["step"], tokens)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh",
    [
        pytest.param(["nproc=4", "parallelism=fsdp"], id="to-fsdp4", marks=MATRIX),  # as to-tp4
        pytest.param(["nproc=4", "parallelism=fsdp", "parallelism.tensor=4"], id="to-tp4"),
        pytest.param(["nproc=2", "parallelism=ddp"], id="to-ddp"),  # at half the ranks
    ],
)
def test_a_tensor_parallel_checkpoint_resumes_on_another_mesh(
    cli, corpus: Path, ddp_and_tp, mesh: list[str]
) -> None:
    """FSDP2 x TP2's first checkpoint goes on at FSDP4, at TP4 (DCP reshards each tensor
    to the new mesh) and at ddp on 2 ranks (every rank reads each tensor whole) to the
    weights of the run that never stopped."""
    reference = ddp_and_tp["fsdp2xtp2"]
    checkpoint = sorted((reference.run_dir / "checkpoints").glob("step_*"))[0]
    second = cli(*tp_args(corpus), *CLIPPED, *mesh, f"resume={checkpoint}", name="second")
    assert second.returncode == 0, second.output
    assert second.summary()["resumed_from"] == int(checkpoint.name.split("_")[1])
    assert max_relative_difference(second.run_dir, reference.run_dir) < 1e-5


@pytest.mark.slow
def test_a_ddp_checkpoint_resumes_under_tensor_parallelism(cli, corpus: Path, ddp_and_tp) -> None:
    """ddp's whole state goes on at FSDP2 x TP2 (each rank cuts its part of every tensor,
    its optimizer state included) to the weights of the ddp run that never stopped."""
    reference = ddp_and_tp["ddp"]
    checkpoint = sorted((reference.run_dir / "checkpoints").glob("step_*"))[0]
    second = cli(
        *tp_args(corpus), *CLIPPED, "nproc=4", "parallelism=fsdp", "parallelism.tensor=2",
        f"resume={checkpoint}", name="second",
    )  # fmt: skip
    assert second.returncode == 0, second.output
    assert second.summary()["resumed_from"] == int(checkpoint.name.split("_")[1])
    assert max_relative_difference(second.run_dir, reference.run_dir) < 1e-5


@pytest.mark.slow
def test_a_tensor_parallel_run_starts_from_weights_saves_async_and_exports(
    cli, corpus: Path, ddp_and_tp, tmp_path: Path
) -> None:
    """init_from under FSDP2 x TP2 (each rank cuts its part of every tensor) trains the
    weights ddp trains from them (on 2 ranks: the same batches); its checkpoints, written
    in the background, export (runner export, each tensor whole) to its model.pt."""
    start = ddp_and_tp["ddp"].run_dir / "model.pt"
    common = [*tp_args(corpus), "max_steps=4", f"init_from={start}", "checkpoint.interval=2"]
    split = cli(
        *common, "nproc=4", "parallelism=fsdp", "parallelism.tensor=2", "checkpoint.async=true",
        name="tp",
    )  # fmt: skip
    assert split.returncode == 0, split.output
    plain = cli(*common, "nproc=2", "parallelism=ddp", name="ddp")
    assert plain.returncode == 0, plain.output
    assert max_relative_difference(split.run_dir, plain.run_dir) < 1e-5
    final = torch.load(split.run_dir / "model.pt", weights_only=True)
    assert not torch.equal(final["lm_head.weight"], torch.load(start)["lm_head.weight"])
    checkpoint = max((split.run_dir / "checkpoints").glob("step_*"))
    assert checkpoint.name.endswith("4")
    assert_exports_model_pt(checkpoint, final, tmp_path / "out")


@pytest.mark.slow
def test_a_nan_on_one_rank_of_a_tensor_group_skips_the_step_everywhere(cli, corpus: Path) -> None:
    """nonfinite=skip, chaos nan: rank 1 (the second rank of the tensor group) has a NaN
    loss at step 3. Every rank drops step 3 and logs it, and TP2 ends on the weights FSDP2
    ends on with the same step dropped (2 ranks: the group is the world)."""
    faults = ["nonfinite=skip", "chaos.kill_rank=1", "chaos.at_step=3", "chaos.action=nan"]
    runs = {
        name: cli(*tp_args(corpus), *faults, "nproc=2", "parallelism=fsdp", *mesh, name=name)
        for name, mesh in (("fsdp2", []), ("tp2", ["parallelism.tensor=2"]))
    }  # fmt: skip
    for result in runs.values():
        assert result.returncode == 0, result.output
        skipped = {m["step"]: m["train/skipped_steps"] for m in result.metrics()}
        assert skipped[2] == 0 and skipped[4] == skipped[6] == 1
        assert "nonfinite: step 3 skipped (non-finite" in result.rank_log(0)
    assert max_relative_difference(runs["tp2"].run_dir, runs["fsdp2"].run_dir) < 1e-5


def test_a_transformers_without_tensor_parallel_styles_is_refused(monkeypatch) -> None:
    """An older transformers (no transformers.distributed.tensor_parallel, as this one is
    made to look by hiding the module) is named before any rank starts, not on the rank."""
    import sys

    from transformers import LlamaConfig, LlamaForCausalLM

    from runner.models.tensor_plans import plan_problems
    from tests.helpers.hugging_face import LLAMA

    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    assert plan_problems(model, 2) == []
    monkeypatch.setitem(sys.modules, "transformers.distributed.tensor_parallel", None)
    (problem,) = plan_problems(model, 2)
    assert problem.startswith("parallelism.tensor=2: a Hugging Face model is split with")
    assert "upgrade transformers, or use parallelism.tensor=1" in problem


@MATRIX
@pytest.mark.slow
def test_a_hugging_face_llama_trains_under_its_own_plan(cli, tmp_path: Path) -> None:
    """A transformers Llama (built from its config, no download) split by its config's
    base_model_tp_plan trains the weights FSDP alone trains; a head count the group does
    not divide is refused, naming it."""
    corpus = text_corpus(tmp_path)
    common = [*llama_args(corpus), "precision=fp32", "max_epochs=null", "max_steps=4",
              "log_interval=2", "nproc=2", "parallelism=fsdp"]  # fmt: skip
    plain = cli(*common, name="fsdp2")
    assert plain.returncode == 0, plain.output
    split = cli(*common, "parallelism.tensor=2", name="tp2")
    assert split.returncode == 0, split.output
    assert "tensor parallelism: groups of 2 ranks split each layer" in split.rank_log(0)
    assert max_relative_difference(split.run_dir, plain.run_dir) < 1e-5
    odd = cli(*common, "model.config.num_key_value_heads=1", "parallelism.tensor=2")
    assert odd.returncode == 2, odd.output
    assert "parallelism.tensor=2: must divide model config num_key_value_heads=1" in odd.output


USER_PLAN = '''
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def plan(model, mesh, first=0):
    """The mlp's first two linear layers: column-wise, then row-wise."""
    linear = [name for name, m in model.named_children() if type(m).__name__ == "Linear"]
    parallelize_module(model, mesh, {linear[first]: ColwiseParallel(),
                                     linear[first + 1]: RowwiseParallel()})
'''


@pytest.mark.slow
def test_a_plan_of_the_users_splits_their_model(cli, tmp_path: Path, mlp_reference) -> None:
    """parallelism.tp_plan names a function of the user's: runner's mlp split by it trains
    the weights plain PyTorch trains (the layers it leaves whole included); a plan that
    cannot be imported is refused before any rank starts."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "myplans.py").write_text(USER_PLAN)
    common = [*ARGS, "nproc=2", "parallelism=fsdp", f"code_dir=[{tmp_path / 'lib'}]"]
    plan = "parallelism.tp_plan={_target_:myplans.plan,first:0}"
    split = cli(*common, "parallelism.tensor=2", plan, name="tp2")
    assert split.returncode == 0, split.output
    weights = torch.load(split.run_dir / "model.pt", weights_only=True)
    assert relative_error(weights, mlp_reference) <= RTOL
    missing = refused(
        *common, "parallelism.tensor=2", "parallelism.tp_plan={_target_:myplans.plam}"
    )
    assert (
        "parallelism.tp_plan._target_=myplans.plam: myplans has no attribute 'plam'; did "
        "you mean plan?" in missing
    )
