"""precision=bf16 means one thing under every parallelism: fp32 weights (the optimizer's and
the ones model.pt holds), the forward pass computed in bf16 under autocast, gradients reduced
in fp32. Real 2-rank runs of a model that reports the dtypes it meets (`dtype probe`), on
ranks that see autocast as a GPU rank sees it (tests.helpers.precision_probe): DeepSpeed's
engine then undoes an enclosing autocast unless it is configured for it, as it does on a
GPU, where `parallelism=zero2 precision=bf16` used to fail with `mat1 and mat2 must have the
same dtype`.

Every parallelism trains ddp's bf16 weights (the splits are equal, so up to the order of
sums), and those are far from fp32 training's: the tolerance tells the precisions apart.
fp16's loss scale under ZeRO is tests/test_zero_fp16.py's (fp16 runs need CUDA).
"""

from __future__ import annotations

import pytest
import torch

from runner.spec import resolve_spec
from tests.helpers.cli import MATRIX
from tests.helpers.config import compose_config
from tests.helpers.equivalence import ARGS, ENGINE_OPTIONS, relative_error, train_plain
from tests.helpers.precision_probe import probed

pytestmark = pytest.mark.slow

PROBE_MODEL = ["model=custom", "model._target_=tests.helpers.precision_probe.ProbeMLP"]
BF16 = [
    *ARGS,
    *PROBE_MODEL,
    "precision=bf16",
    "nproc=2",
    "callbacks=[{_target_: tests.helpers.precision_probe.AutocastAsOnCuda, ranks: all}]",
]
SAME = 1e-6  # measured when written: 0.0 for every parallelism against ddp
APART = 1e-4  # bf16 against fp32 training after these 20 steps: 3e-3 when written


@pytest.fixture(scope="module")
def fp32_weights() -> dict[str, torch.Tensor]:
    """The probe model trained in fp32 by plain PyTorch on whole global batches."""
    return train_plain(resolve_spec(compose_config([*ARGS, *PROBE_MODEL, "nproc=1"])))


@pytest.fixture(scope="module")
def ddp_bf16(tmp_path_factory) -> dict[str, torch.Tensor]:
    from tests.helpers.cli import run_cli

    run = run_cli(tmp_path_factory.mktemp("ddp"), *BF16, "parallelism=ddp")
    assert run.returncode == 0, run.output
    seen = probed(run.rank_log(1))
    assert seen == {"input": "float32", "weight": "float32", "output": "bfloat16"}
    return torch.load(run.run_dir / "model.pt", weights_only=True)


@pytest.mark.parametrize(
    "parallelism",
    [
        pytest.param("zero1", marks=MATRIX),
        pytest.param("zero2", marks=pytest.mark.floor),
        pytest.param("zero3", marks=MATRIX),
        "fsdp",
    ],
)
def test_bf16_is_autocast_over_fp32_weights(cli, parallelism, ddp_bf16, fp32_weights):
    run = cli(*BF16, f"parallelism={parallelism}", *ENGINE_OPTIONS.get(parallelism, []))
    assert run.returncode == 0, run.output
    seen = probed(run.rank_log(1))
    assert seen["output"] == "bfloat16"
    # FSDP2 computes with its gathered weights (and inputs) cast to bf16, its shards fp32;
    # the others keep fp32 weights that autocast casts op by op
    expected = "bfloat16" if parallelism == "fsdp" else "float32"
    assert (seen["input"], seen["weight"]) == (expected, expected)
    weights = torch.load(run.run_dir / "model.pt", weights_only=True)
    assert all(w.dtype == torch.float32 for w in weights.values())
    assert relative_error(weights, ddp_bf16) < SAME
    assert relative_error(weights, fp32_weights) > APART
    states = run.summary()["state_bytes"]
    params = sum(p.numel() for p in fp32_weights.values())
    if parallelism in ("zero1", "zero2"):  # every rank holds the whole fp32 weights
        assert all(s["params"] >= 4 * params for s in states), states
