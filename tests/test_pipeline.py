"""Pipeline parallelism (parallelism.pipeline): the gpt cut into stages over groups of ranks
trains the weights ddp trains, under every schedule runner offers, beside FSDP's sharding
and HSDP's copies; its checkpoints resume at another pipeline degree and under ddp, and
theirs under it; what cannot run is refused before any rank starts.

One epoch of 260 samples in global batches of 12: its last batch holds 8, so the pipeline's
padded microbatches are tried too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runner.models.pipeline_stages import layer_ranges, stage_problems
from runner.spec import resolve_spec
from runner.spec.mesh import Layout
from tests.helpers.cli import MATRIX, CliResult, run_cli
from tests.helpers.config import compose_config
from tests.helpers.equivalence import relative_error
from tests.helpers.hugging_face import llama_args, text_corpus
from tests.helpers.refusals import refused
from tests.helpers.shared_runs import SharedRuns

RTOL = 1e-5


def pp_args(root: Path) -> list[str]:
    return [
        "model=gpt",
        "model.n_layer=4",
        "model.n_head=2",
        "model.n_embd=32",
        "model.bias=false",
        "data=text",
        f"data.root={root}",
        "data.block_size=23",  # odd: a tensor group of 2 pads the sequence
        "loss=causal_lm",
        "metrics=language_model",
        "precision=fp32",
        "progress_bar=false",
        "scheduler=constant",
        "global_batch_size=12",
        "max_epochs=1",
        "log_interval=2",
        "grad_clip_norm=0.5",  # clipping reads the norm across the stages
        "checkpoint.interval=10",
    ]


@pytest.fixture(scope="module")
def pp_run(tmp_path_factory, corpus: Path) -> SharedRuns:
    """`pp_run(*overrides)`: one run of the module's gpt with these overrides, made once."""
    return SharedRuns(tmp_path_factory.mktemp("pipeline_runs"), pp_args(corpus))


@pytest.fixture(scope="module")
def ddp(pp_run) -> CliResult:
    return pp_run("nproc=1", "parallelism=ddp", "grad_accum=4")


def assert_same_training(result: CliResult, reference: CliResult) -> None:
    """The same weights, validation loss and, at every log step, loss and gradient norm."""
    weights = torch.load(result.run_dir / "model.pt", weights_only=True)
    expected = torch.load(reference.run_dir / "model.pt", weights_only=True)
    assert list(weights) == list(expected)  # model.pt: every stage's, in the model's order
    assert relative_error(weights, expected) <= RTOL
    final, reference_final = result.summary()["final"], reference.summary()["final"]
    assert final["val/loss"] == pytest.approx(reference_final["val/loss"], rel=RTOL)
    records, others = result.metrics(), reference.metrics()
    assert [r["step"] for r in records] == [r["step"] for r in others]
    for mine, theirs in zip(records, others, strict=True):
        assert mine["train/loss"] == pytest.approx(theirs["train/loss"], rel=RTOL)
        assert mine["train/grad_norm"] == pytest.approx(theirs["train/grad_norm"], rel=1e-4)
        assert mine["throughput/tokens_per_sec"] > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule",
    [
        # make test: one schedule of one stage a rank, one of two (runner's only code of its
        # own for a schedule is the name it maps to torch's class); the rest are the matrix's
        "1f1b",
        "interleaved_1f1b",
        pytest.param("gpipe", marks=MATRIX),
        pytest.param("looped_bfs", marks=MATRIX),
    ],
)
def test_every_schedule_trains_what_ddp_trains(pp_run, ddp, schedule: str) -> None:
    """pipeline=2 on 2 ranks: 2 stages of 2 blocks (1f1b, gpipe), or 4 stages of one, two a
    rank (interleaved_1f1b, looped_bfs). 1f1b, the default, is the run of COMPILED (its
    blocks compiled one by one: one run for both claims)."""
    schedule_key = () if schedule == "1f1b" else (f"parallelism.pipeline_schedule={schedule}",)
    result = pp_run(*PIPELINED, *schedule_key, *(COMPILED if schedule == "1f1b" else ()))
    assert result.summary()["world_size"] == 2
    assert_same_training(result, ddp)


# The pipeline of 2 stages on 2 ranks, its default schedule (1f1b): the tests of schedules,
# compile and resume read one run of it, its blocks compiled by aot_eager.
PIPELINED = ("nproc=2", "parallelism=fsdp", "parallelism.pipeline=2", "grad_accum=4")
COMPILED = ("compile={backend:aot_eager}",)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(("parallelism.replicate=1",), id="pipeline2-shard2"),
        pytest.param(("parallelism.replicate=2",), id="pipeline2-hsdp2", marks=MATRIX),
        # clipped: the matrix's; make test trains pipeline=2 x tensor=2 unclipped, to the same
        # weights, losses and norms (test_the_logged_gradient_norm_adds_every_stages_...)
        pytest.param(("parallelism.tensor=2",), id="pipeline2-tensor2", marks=MATRIX),
    ],
)
def test_pipeline_beside_sharding_trains_what_ddp_trains(pp_run, ddp, layout) -> None:
    """4 ranks: two stage groups, each sharding (or replicating) its stage over 2 ranks that
    read their own halves of the batch, or splitting each of its layers over 2 ranks that
    read the same batch (tensor parallelism: a stage sends its part of the sequence)."""
    result = pp_run(
        "nproc=4", "parallelism=fsdp", "parallelism.pipeline=2", *layout, "grad_accum=2"
    )
    assert_same_training(result, ddp)


@pytest.mark.slow
@pytest.mark.parametrize(
    "backend", ["aot_eager", pytest.param("inductor", marks=MATRIX)]
)  # fmt: skip
def test_blocks_compiled_one_by_one_train_what_ddp_trains(pp_run, ddp, backend: str) -> None:
    """compile per block before the stages are cut: each stage runs its compiled blocks."""
    result = pp_run(*PIPELINED, f"compile={{backend:{backend}}}")
    assert result.summary()["compile_s"] > 0
    assert "blocks (Block) compiled one by one" in result.rank_log(0)
    assert_same_training(result, ddp)


@MATRIX
@pytest.mark.slow
def test_the_logged_gradient_norm_adds_every_stages_without_clipping(tmp_path, corpus) -> None:
    """Unclipped, pipeline=2 x tensor=2 logs the norm DTensor reduces over each stage's mesh,
    shared once among the stage's ranks, and trains what ddp trains (make test's run of a
    pipeline beside tensor parallelism; clipped, it is the matrix's)."""
    args = [a for a in pp_args(corpus) if not a.startswith("grad_clip_norm")]
    reference = run_cli(tmp_path, *args, "nproc=1", "parallelism=ddp", "grad_accum=4", name="ddp")
    assert reference.returncode == 0, reference.output
    layout = ("nproc=4", "parallelism=fsdp", "parallelism.pipeline=2", "parallelism.tensor=2")
    result = run_cli(tmp_path, *args, *layout, "grad_accum=2", name="pp2-tp2")
    assert result.returncode == 0, result.output
    assert_same_training(result, reference)


@pytest.mark.slow
def test_checkpoints_resume_across_pipeline_degrees_and_engines(pp_run, ddp) -> None:
    """A pipeline=2 checkpoint goes on at pipeline=1 and under ddp; a ddp checkpoint goes on
    under pipeline=2 x shard=2 (DCP by name; ddp's whole state, stage by stage)."""
    pipelined = pp_run(*PIPELINED, *COMPILED)  # resumed uncompiled: the same weights
    for source, targets in (
        (
            pipelined,
            [
                ("nproc=1", "parallelism=fsdp", "grad_accum=4"),
                ("nproc=2", "parallelism=ddp", "grad_accum=2"),
            ],
        ),
        (ddp, [("nproc=4", "parallelism=fsdp", "parallelism.pipeline=2", "grad_accum=2")]),
    ):
        checkpoint = sorted((source.run_dir / "checkpoints").glob("step_*"))[0]
        for target in targets:
            resumed = pp_run(*target, f"resume={checkpoint}")
            assert resumed.summary()["resumed_from"] == int(checkpoint.name.split("_")[1])
            weights = torch.load(resumed.run_dir / "model.pt", weights_only=True)
            expected = torch.load(ddp.run_dir / "model.pt", weights_only=True)
            assert relative_error(weights, expected) <= RTOL, target


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(("nproc=2", "parallelism.pipeline=2"), id="pipeline2"),
        pytest.param(
            ("nproc=4", "parallelism.pipeline=2", "parallelism.tensor=2"),
            id="pipeline2-tensor2",
            marks=MATRIX,
        ),
    ],
)
def test_a_hugging_face_decoder_is_cut_by_its_layer_list(cli, tmp_path: Path, layout) -> None:
    """A transformers Llama (built from its config, no download): embeddings with the first
    stage, norm and head with the last, the rotary embedding on both; the weights plain
    PyTorch trains in one process on whole global batches, and model.pt under the model's
    own names. Beside tensor parallelism each stage's layers split by transformers' plan,
    which passes whole activations."""
    from tests.helpers.language_model import STEPS, train_plain

    corpus = text_corpus(tmp_path)
    args = [a for a in llama_args(corpus) if not a.startswith("data.min_length")]
    common = [*args, "precision=fp32", "max_epochs=null", f"max_steps={STEPS}"]
    common += ["log_interval=2", "parallelism=fsdp", "grad_accum=2"]
    staged = cli(*common, *layout, name="pipeline2")
    assert staged.returncode == 0, staged.output
    weights = torch.load(staged.run_dir / "model.pt", weights_only=True)
    expected = train_plain(resolve_spec(compose_config([*common, "nproc=1", "device=cpu"])))
    assert list(weights) == list(expected)
    assert relative_error(weights, expected) <= RTOL


USER_CUT = '''
from torch import nn


def cut(model, stage, stages):
    """runner's mlp (Flatten, Linear, ReLU, Linear, ReLU, Linear) in two stages."""
    layers = list(model.children())
    return nn.Sequential(*(layers[:3] if stage == 0 else layers[3:]))
'''


@pytest.mark.slow
def test_a_cut_of_the_users_pipelines_their_model(cli, tmp_path: Path) -> None:
    """parallelism.pp_plan names a function of the user's that returns each stage: runner's
    mlp in two stages trains plain PyTorch's weights, and model.pt keeps the model's names; a
    cut that cannot be imported, and compile (the mlp has no blocks to compile one by one),
    are refused before any rank starts."""
    from tests.helpers.equivalence import train_plain

    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "mycuts.py").write_text(USER_CUT)
    common = ["model=mlp", "data=digits", "precision=fp32", "progress_bar=false"]
    common += ["max_epochs=null", "max_steps=12", "grad_accum=2", "global_batch_size=32"]
    common += [f"code_dir=[{tmp_path / 'lib'}]", "nproc=2", "parallelism=fsdp"]
    cut = "parallelism.pp_plan={_target_:mycuts.cut}"
    staged = cli(*common, "parallelism.pipeline=2", cut, name="pp")
    assert staged.returncode == 0, staged.output
    weights = torch.load(staged.run_dir / "model.pt", weights_only=True)
    expected = train_plain(resolve_spec(compose_config([*common, "nproc=1", "device=cpu"])))
    assert list(weights) == list(expected)
    assert relative_error(weights, expected) <= RTOL
    missing = refused(
        *common, "parallelism.pipeline=2", "parallelism.pp_plan={_target_:mycuts.cutt}"
    )
    assert "parallelism.pp_plan._target_=mycuts.cutt: mycuts has no attribute 'cutt'" in missing
    compiled = refused(*common, "parallelism.pipeline=2", cut, "compile=true")
    assert "compile: under parallelism.pipeline runner compiles the model's blocks" in compiled


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (
            ("nproc=3", "parallelism.pipeline=2"),
            "parallelism.pipeline=2: groups of equal size must divide the world size",
        ),
        (
            ("nproc=2", "parallelism.pipeline=2", "grad_accum=auto"),
            "grad_accum=auto: not with parallelism.pipeline",
        ),
        (
            ("nproc=2", "parallelism.pipeline=2", "grad_accum=1"),
            "grad_accum=1: parallelism.pipeline_schedule=1f1b needs at least 2 (one per stage)",
        ),
        (
            (
                "nproc=2",
                "parallelism.pipeline=2",
                "parallelism.pipeline_schedule=zbv_zero_bubble",
                "grad_accum=4",
            ),
            "parallelism.pipeline_schedule='zbv_zero_bubble': expected one of gpipe, 1f1b, "
            "interleaved_1f1b, looped_bfs",
        ),
        (
            ("nproc=2", "parallelism.pipeline=2", "parallelism.stages_per_rank=2", "grad_accum=2"),
            "parallelism.stages_per_rank=2: parallelism.pipeline_schedule=1f1b runs one stage",
        ),
        (
            ("nproc=2", "parallelism.pipeline=2", "compile={per_block:false}", "grad_accum=2"),
            "compile.per_block=false: under parallelism.pipeline each stage runs its own",
        ),
    ],
)
def test_a_pipeline_that_cannot_run_is_refused(overrides, problem: str) -> None:
    from runner.spec import resolve_spec
    from runner.spec.convert import SpecError

    config = compose_config(["parallelism=fsdp", "model=gpt", "device=cpu", *overrides])
    with pytest.raises(SpecError) as refused:
        resolve_spec(config)
    assert problem in str(refused.value)


def test_pipeline_under_ddp_or_zero_is_refused_naming_why() -> None:
    found = refused("nproc=2", "parallelism=zero2", "parallelism.pipeline=2")
    assert "not a key of the chosen parallelism option; only of parallelism=fsdp" in found
    assert "DeepSpeed's ZeRO partitions the whole model" in found


def test_stage_splits_and_what_cannot_be_split() -> None:
    from runner.models.gpt import GPT

    with torch.device("meta"):
        gpt = GPT(vocab_size=10, block_size=8, n_layer=6, n_head=2, n_embd=8)
    assert layer_ranges(6, 3) == [range(0, 2), range(2, 4), range(4, 6)]
    assert layer_ranges(6, 2, (1, 5)) == [range(0, 1), range(1, 6)]
    assert stage_problems(gpt, 3, ()) == []
    assert (
        "do not divide GPT's 6 layers; stages that do: [1, 2, 3, 6]"
        in stage_problems(gpt, 4, ())[0]
    )
    assert "needs 2 counts" in stage_problems(gpt, 2, (3, 2, 1))[0]
    assert (
        "has no stage split" in stage_problems(torch.nn.Sequential(torch.nn.Linear(2, 2)), 2, ())[0]
    )


def test_the_mesh_puts_the_pipeline_outermost() -> None:
    """8 ranks as pipeline 2 x shard 2 x tensor 2: ranks 0-3 hold the first stage; ranks 0
    and 4 read the same part of the batch; one rank of each tensor group of the first stage
    counts the tokens."""
    grid = Layout(replicate=1, shard=2, tensor=2, pipeline=2)
    assert grid.world == 8 and grid.stage_world == 4 and grid.copies == 4
    assert [grid.pipeline_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [grid.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [r for r in range(8) if grid.counts_items(r)] == [0, 2]
