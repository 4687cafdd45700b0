"""precision=float8 (torchao's float8 training, emulated on CPU as torchao's own tests run
it): the gpt's linear layers convert, train close to bf16, checkpoint and resume bit for
bit; under fsdp the weights are gathered in float8, and `runner export` gives plain weights;
what cannot run is refused before any rank starts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from runner.engines.float8 import layer_filter
from runner.hardware import float8_problem
from runner.spec.schema import PrecisionSpec
from tests.helpers.cli import MATRIX, CliResult, run_cli
from tests.helpers.config import compose_config
from tests.helpers.language_model import lm_args
from tests.helpers.weights import assert_exports_model_pt

# every linear layer of the 32-wide gpt but the head: too small for torchao's size rule
FLOAT8 = ("precision=float8", "precision.auto_filter=false")
CONVERTED = "float8 (tensorwise): 8 of 9 linear layers converted; 1 stay bf16"


@pytest.fixture(scope="module")
def f8_run(tmp_path_factory, corpus: Path):
    """`f8_run(*overrides)`: one 6-step run of the gpt on 2 ranks, made once."""
    root = tmp_path_factory.mktemp("float8_runs")
    runs: dict[tuple[str, ...], CliResult] = {}

    def run(*overrides: str) -> CliResult:
        if overrides not in runs:
            args = [*lm_args(corpus), "max_steps=6", "checkpoint.interval=3", "nproc=2"]
            runs[overrides] = run_cli(root, *args, *overrides, name=f"run{len(runs)}")
            assert runs[overrides].returncode == 0, runs[overrides].output
        return runs[overrides]

    return run


def losses(result: CliResult) -> list[float]:
    return [r["train/loss"] for r in result.metrics()]


@pytest.mark.slow
def test_float8_trains_close_to_bf16(f8_run) -> None:
    """ddp: the layers convert (the log says which), the losses stay within 2% of bf16's
    without being bf16's."""
    bf16 = f8_run("precision=bf16")
    float8 = f8_run(*FLOAT8)
    assert CONVERTED in float8.rank_log(0)
    assert losses(float8) != losses(bf16)
    assert losses(float8) == pytest.approx(losses(bf16), rel=0.02)


@MATRIX  # make test resumes fsdp's float8 run (below), its weights gathered in float8
@pytest.mark.slow
def test_a_ddp_float8_run_resumes_bit_for_bit(f8_run) -> None:
    """A run resumed from its step-3 checkpoint ends on the weights of the run that never
    stopped."""
    float8 = f8_run(*FLOAT8)
    checkpoint = sorted((float8.run_dir / "checkpoints").glob("step_*"))[0]
    resumed = f8_run(*FLOAT8, f"resume={checkpoint}")
    assert resumed.summary()["resumed_from"] == 3
    weights = torch.load(resumed.run_dir / "model.pt", weights_only=True)
    expected = torch.load(float8.run_dir / "model.pt", weights_only=True)
    assert all(torch.equal(weights[k], v) for k, v in expected.items())


@pytest.mark.slow
def test_fsdp_gathers_float8_weights_and_exports_plain_ones(f8_run, tmp_path: Path) -> None:
    """fsdp, tensorwise: FSDP gathers the weights in float8 (scales computed after each
    step); its losses are ddp's float8 ones, its checkpoints (plain tensors) resume bit for
    bit, and `runner export` of its last one gives model.pt's tensors."""
    sharded = f8_run(*FLOAT8, "parallelism=fsdp")
    assert "weights gathered in float8" in sharded.rank_log(0)
    assert losses(sharded) == pytest.approx(losses(f8_run(*FLOAT8)), rel=0.005)
    final = torch.load(sharded.run_dir / "model.pt", weights_only=True)
    checkpoint = sorted((sharded.run_dir / "checkpoints").glob("step_*"))[0]
    resumed = f8_run(*FLOAT8, "parallelism=fsdp", f"resume={checkpoint}")
    ended = torch.load(resumed.run_dir / "model.pt", weights_only=True)
    assert all(torch.equal(ended[k], v) for k, v in final.items())
    assert all(type(v) is torch.Tensor and v.dtype == torch.float32 for v in final.values())
    last = max((sharded.run_dir / "checkpoints").glob("step_*"))
    assert_exports_model_pt(last, final, tmp_path / "out")


@MATRIX
@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(("parallelism.tensor=2",), id="tensor2"),
        pytest.param(("precision.recipe=rowwise",), id="rowwise"),
        pytest.param(("compile={backend:aot_eager}",), id="compiled"),
    ],
)
def test_float8_composes(f8_run, layout) -> None:
    """float8 under fsdp beside tensor parallelism (a tensor group of 2: each tensorwise
    scale is the whole tensor's, reduced over the group), rowwise, and compiled: the losses
    of the same recipe under ddp, eager. (Weights are no measure here: AdamW's first steps
    move each weight by about the learning rate whatever its gradient's size, so float8's
    rounding of small gradients moves the weights as far apart as bf16's and float8's.)"""
    recipe = [o for o in layout if o.startswith("precision.recipe")]
    result = f8_run(*FLOAT8, "parallelism=fsdp", *layout)
    reference = f8_run(*FLOAT8, *recipe)
    assert losses(result) == pytest.approx(losses(reference), rel=0.005)


def test_which_layers_convert() -> None:
    """Multiples of 16 only; filter_fqns by name; torchao's size rule unless turned off."""
    from torch import nn

    spec = PrecisionSpec(name="float8", filter_fqns=("lm_head",), auto_filter=False)
    converts = layer_filter(spec)
    assert converts(nn.Linear(32, 96), "blocks.0.attn.qkv")
    assert not converts(nn.Linear(32, 96), "lm_head")
    assert not converts(nn.Linear(30, 96), "blocks.0.attn.qkv")
    assert not converts(nn.LayerNorm(32), "ln_f")
    sized = layer_filter(PrecisionSpec(name="float8", auto_filter=True))
    assert not sized(nn.Linear(768, 768), "blocks.0.attn.proj")  # gains nothing at this size
    assert sized(nn.Linear(4096, 8192), "blocks.0.mlp.0")


def test_a_gpu_without_float8_matmuls_is_refused() -> None:
    assert float8_problem([9.0]) is None
    assert float8_problem([]) is None  # unknown: the rank finds out
    problem = float8_problem([8.0, 9.0])
    assert problem is not None and "compute capability 8.9 or newer" in problem
    assert "this machine's is 8" in problem and "use precision=bf16" in problem


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (("parallelism=zero2",), "precision=float8: not under parallelism=zero2"),
        (("parallelism=ddp", "precision.recipe=blockwise"), "precision.recipe"),
    ],
)
def test_float8_that_cannot_run_is_refused(overrides, problem: str) -> None:
    from runner.spec import resolve_spec
    from runner.spec.convert import SpecError

    config = compose_config(["model=gpt", "device=cpu", "nproc=2", "precision=float8", *overrides])
    with pytest.raises(SpecError) as refused:
        resolve_spec(config)
    assert problem in str(refused.value)


def test_float8_without_torchao_says_how_to_install(monkeypatch) -> None:
    from runner.spec import resolve_spec
    from runner.spec.convert import SpecError

    monkeypatch.setitem(sys.modules, "torchao", None)  # not importable, as where not installed
    config = compose_config(["model=gpt", "device=cpu", "precision=float8"])
    with pytest.raises(SpecError) as refused:
        resolve_spec(config)
    assert "needs torchao, which is not installed; pip install 'runner[float8]'" in str(
        refused.value
    )


def test_a_model_with_nothing_to_convert_is_told_so() -> None:
    """A model whose layers are all too small for torchao's rule trains in bf16: said on
    the terminal, with the key that converts them anyway."""
    from torch import nn

    from runner.engines.float8 import convert

    said: list[str] = []
    small = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32))
    assert convert(small, PrecisionSpec(name="float8"), "cpu", False, said.append) == 0
    assert said and "none of the model's 2 linear layers converts" in said[0]
    assert "precision.auto_filter=false" in said[0]
    said.clear()
    every = PrecisionSpec(name="float8", auto_filter=False)
    assert convert(small, every, "cpu", False, said.append) == 2 and not said
    assert type(small[0]).__name__ == "Float8Linear"
