"""The CUDA paths on a real GPU: one-rank NCCL runs of every parallelism, bf16 and fp16
(GradScaler; DeepSpeed's own scaler under ZeRO), channels_last, torch.compile with triton
kernels, grad_accum=auto against a real out-of-memory error, and model.pt that loads on a
machine without a GPU. `make test-gpu`; skipped without CUDA."""

from __future__ import annotations

import math

import pytest
import torch

from runner.data.datasets import build_datasets
from runner.models import build_model
from runner.spec import load_spec
from tests.conftest import FAST
from tests.helpers.equivalence import relative_error

GPU = ["device=cuda", "nproc=1", "max_epochs=null", "max_steps=20", "log_interval=5"]
PARALLELISMS = ["ddp", "zero1", "zero2", "zero3", "fsdp"]


def check_trained(run) -> dict:
    assert run.returncode == 0, run.output
    assert "process group: nccl, device cuda:0" in run.rank_log(0)
    summary = run.summary()
    assert summary["status"] == "completed" and summary["device"] == "cuda"
    losses = [r["train/loss"] for r in run.metrics() if "train/loss" in r]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    return summary


def load_on_cpu(run) -> torch.nn.Module:
    """model.pt into the model its config builds, on a CPU, strictly."""
    spec = load_spec(run.run_dir)
    model = build_model(spec.model, build_datasets(spec.data).info)
    weights = torch.load(run.run_dir / "model.pt", map_location="cpu", weights_only=True)
    model.load_state_dict(weights)
    assert all(t.device.type == "cpu" for t in weights.values())
    return model


@pytest.mark.parametrize("parallelism", PARALLELISMS)
def test_every_parallelism_trains_over_nccl_and_its_model_loads_on_cpu(cli, parallelism):
    run = cli(*FAST, *GPU, f"parallelism={parallelism}")
    check_trained(run)
    load_on_cpu(run)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("parallelism", ["ddp", "zero2", "fsdp"])
def test_mixed_precision(cli, parallelism, precision):
    summary = check_trained(cli(*FAST[:-2], *GPU, f"parallelism={parallelism}",
                                f"precision={precision}", "progress_bar=false"))  # fmt: skip
    assert summary["precision"] == precision


def test_precision_auto_picks_bf16_on_a_gpu_that_has_it(cli):
    run = cli(*FAST[:-2], *GPU, "precision=auto", "max_steps=5", "progress_bar=false")
    expected = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    assert check_trained(run)["precision"] == expected


def test_channels_last_resnet(cli):
    run = cli("model=resnet18", "model.channels_last=true", "data=synthetic", *GPU,
              "max_steps=10", "progress_bar=false", "precision=bf16")  # fmt: skip
    check_trained(run)
    load_on_cpu(run)


@pytest.mark.parametrize(("model", "parallelism"), [("mlp", "ddp"), ("gpt", "fsdp")])
def test_compile_with_triton_matches_eager(cli, tmp_path, model, parallelism):
    if model == "gpt":
        root = tmp_path / "corpus"
        root.mkdir()
        (root / "doc.txt").write_text("the runner trains a tiny gpt on the gpu. " * 400)
        overrides = ["model=gpt", "data=text", f"data.root={root}", "loss=causal_lm",
                     "metrics=language_model", "data.block_size=64"]  # fmt: skip
    else:
        overrides = FAST[:2]
    common = [*overrides, *GPU, f"parallelism={parallelism}", "progress_bar=false"]
    compiled = cli(*common, "compile=true", name="compiled", timeout=600)
    summary = check_trained(compiled)
    assert summary["compile_s"] > 0
    eager = cli(*common, name="eager")
    check_trained(eager)
    a = torch.load(compiled.run_dir / "model.pt", weights_only=True)
    b = torch.load(eager.run_dir / "model.pt", weights_only=True)
    assert relative_error(a, b) < 1e-3  # TF32 and fused kernels round differently on a GPU


def test_grad_accum_auto_recovers_from_a_real_out_of_memory_error(cli):
    batch = 256
    run = cli("model=custom", "model._target_=tests.gpu.memory_hog.MemoryHog",
              f"+model.batch={batch}", "data=synthetic", f"global_batch_size={batch}",
              "grad_accum=auto", *GPU, "max_steps=3", "progress_bar=false",
              "metrics=none")  # fmt: skip
    assert run.returncode == 0, run.output
    summary = run.summary()
    assert (summary["grad_accum"], summary["micro_batch_size"]) == (2, batch // 2)
    assert summary["microbatch_retries"][0]["step"] == 1
    assert "CUDA out of memory" in run.rank_log(0)
