"""The CUDA paths on one real GPU: one-rank NCCL runs of every parallelism in fp32, bf16 and
fp16 (autocast over fp32 weights everywhere; GradScaler, or runner's loss scale under ZeRO),
meta init, asynchronous checkpoints and a bit-identical restart, init_from, `runner export`
and `runner eval` from a GPU run, the non-finite guard, memory and MFU figures,
channels_last, torch.compile with triton kernels, and no host sync on a step that logs
nothing (`sync_debug=error`: torch raises at any wait). `make test-gpu` (tests/gpu/suite.py);
skipped without CUDA. Every test works in its own directory, so they run side by side
(`pytest -n auto`); the out-of-memory test is tests/gpu/test_out_of_memory.py, run alone.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.helpers.cli import FAST, child_env
from tests.helpers.equivalence import relative_error
from tests.helpers.gpu_runs import GPU, check_trained, gpt_args, load_on_cpu
from tests.helpers.precision_probe import probed
from tests.helpers.weights import same_weights

PARALLELISMS = ["ddp", "zero1", "zero2", "zero3", "fsdp"]
PROBE = ["model=custom", "model._target_=tests.helpers.precision_probe.ProbeMLP", "data=digits"]


@pytest.mark.parametrize("parallelism", PARALLELISMS)
def test_every_parallelism_trains_over_nccl_and_its_model_loads_on_cpu(cli, parallelism):
    run = cli(*FAST, *GPU, f"parallelism={parallelism}")
    check_trained(run)
    load_on_cpu(run)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("parallelism", PARALLELISMS)
def test_mixed_precision_is_autocast_over_fp32_weights(cli, parallelism, precision):
    """What tests/test_mixed_precision.py checks on CPU, on the GPU itself: the model sees
    fp32 weights (FSDP2: its gathered bf16/fp16 copies) and computes in 16 bits."""
    run = cli(*PROBE, *GPU, f"parallelism={parallelism}", f"precision={precision}",
              "progress_bar=false")  # fmt: skip
    assert check_trained(run)["precision"] == precision
    seen = probed(run.rank_log(0))
    half = {"bf16": "bfloat16", "fp16": "float16"}[precision]
    assert seen["output"] == half
    assert seen["weight"] == (half if parallelism == "fsdp" else "float32")
    weights = torch.load(run.run_dir / "model.pt", map_location="cpu", weights_only=True)
    assert all(w.dtype == torch.float32 for w in weights.values())


def test_precision_auto_picks_bf16_on_a_gpu_that_has_it(cli):
    run = cli(*FAST[:-2], *GPU, "precision=auto", "max_steps=10", "log_interval=2",
              "progress_bar=false")  # fmt: skip
    expected = "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    assert check_trained(run)["precision"] == expected


@pytest.mark.parametrize("parallelism", ["fsdp", "zero3"])
def test_meta_init_builds_only_this_rank_s_shards(cli, parallelism):
    run = cli(*FAST, *GPU, f"parallelism={parallelism}", "parallelism.meta_init=true")
    check_trained(run)
    load_on_cpu(run)


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_async_checkpoint_and_a_restart_end_bit_for_bit(cli, parallelism):
    """checkpoint.async on CUDA (pinned staging), then a rank killed at step 15: the restart
    from the newest sealed checkpoint ends on the uninterrupted run's weights, bit for bit.
    Each save first waits for the write before it, so step 8's is sealed by step 12's save;
    step 12's may still be writing when the rank dies (a GPU's steps take milliseconds), and
    an unsealed checkpoint is never the resume point."""
    common = [*FAST, *GPU, f"parallelism={parallelism}", "max_steps=16", "log_interval=2",
              "checkpoint.interval=4", "checkpoint.async=true"]  # fmt: skip
    whole = cli(*common, name="whole")
    check_trained(whole)
    killed = cli(*common, "chaos.kill_rank=0", "chaos.at_step=15", "max_restarts=1", name="killed")
    summary = check_trained(killed)
    assert summary["restarts"] == 1 and summary["resumed_from"] in (8, 12), summary
    assert same_weights(whole.run_dir, killed.run_dir)


def test_init_from_export_and_eval_of_a_gpu_run(cli, tmp_path):
    run = cli(*FAST, *GPU, "parallelism=fsdp", "precision=bf16", name="train")
    check_trained(run)
    last_val = [r["val/loss"] for r in run.metrics() if "val/loss" in r][-1]
    evaluated = cli("eval", str(run.run_dir), "device=cuda", "nproc=1", name="eval")
    assert evaluated.returncode == 0, evaluated.output
    metrics = json.loads((evaluated.run_dir / "eval.json").read_text())["metrics"]
    assert metrics["val/loss"] == pytest.approx(last_val, rel=1e-3)  # bf16 on the same GPU
    exported = subprocess.run(
        [sys.executable, "-m", "runner.cli.entry", "export", str(run.run_dir), "--to",
         str(tmp_path / "exported")],
        capture_output=True, text=True, env=child_env(), timeout=300,
    )  # fmt: skip
    assert exported.returncode == 0, exported.stderr
    tuned = cli(*FAST, *GPU, f"init_from={run.run_dir / 'model.pt'}", "max_steps=4",
                "log_interval=2", name="tuned")  # fmt: skip
    check_trained(tuned)


def test_a_nan_stops_the_run_and_names_its_step(cli):
    run = cli(*FAST, *GPU, "chaos.kill_rank=0", "chaos.at_step=6", "chaos.action=nan")
    assert run.returncode != 0
    summary = run.summary()
    assert summary["status"] == "failed"
    assert "non-finite loss (NaN or inf) at step 6" in summary["error"]["message"]


def test_memory_and_mfu_are_plausible(cli, tmp_path):
    run = cli(*gpt_args(tmp_path / "corpus"), *GPU, "precision=bf16")
    check_trained(run)
    total_mb = torch.cuda.get_device_properties(0).total_memory / 2**20
    records = [r for r in run.metrics() if "throughput/mfu" in r]
    assert records, "a GPU the MFU table knows gives throughput/mfu"
    for record in records:
        assert 0 < record["memory/peak_mb"] < total_mb
        assert 0 < record["throughput/mfu"] < 1
        assert record["throughput/tokens_per_sec"] > 0


def test_channels_last_resnet(cli):
    run = cli("model=resnet18", "model.channels_last=true", "data=synthetic", *GPU,
              "max_steps=10", "progress_bar=false", "precision=bf16")  # fmt: skip
    check_trained(run)
    load_on_cpu(run)


@pytest.mark.parametrize(("model", "parallelism"), [("mlp", "ddp"), ("gpt", "fsdp")])
def test_compile_with_triton_matches_eager(cli, tmp_path, model, parallelism):
    overrides = gpt_args(tmp_path / "corpus") if model == "gpt" else FAST
    common = [*overrides, *GPU, f"parallelism={parallelism}", "progress_bar=false"]
    compiled = cli(*common, "compile=true", name="compiled", timeout=600)
    summary = check_trained(compiled)
    assert summary["compile_s"] > 0
    eager = cli(*common, name="eager")
    check_trained(eager)
    a = torch.load(compiled.run_dir / "model.pt", weights_only=True)
    b = torch.load(eager.run_dir / "model.pt", weights_only=True)
    assert relative_error(a, b) < 1e-3  # TF32 and fused kernels round differently on a GPU


@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_no_host_sync_on_a_step_that_logs_nothing(cli, tmp_path, parallelism):
    """sync_debug=error: torch raises wherever the host waits for the GPU on a step that
    logs nothing (runner.train.step.sync_debug). ZeRO is left out: DeepSpeed reads whether the
    gradient norm is finite every step, by design."""
    run = cli(*gpt_args(tmp_path / "corpus"), *GPU, f"parallelism={parallelism}",
              "precision=bf16", "sync_debug=error", "grad_clip_norm=1.0")  # fmt: skip
    check_trained(run)


@pytest.mark.parametrize(
    ("parallelism", "recipe"), [("ddp", "tensorwise"), ("fsdp", "tensorwise"), ("ddp", "rowwise")]
)
def test_float8_trains_on_the_gpu_close_to_bf16(cli, tmp_path, parallelism, recipe):
    """precision=float8 with compile on a GPU of compute capability 8.9+ (refused below,
    which the second half checks where the GPU is older): real float8 matmuls, the losses
    close to bf16's, model.pt plain fp32 tensors."""
    pytest.importorskip("torchao", reason="precision=float8 needs torchao ('runner[float8]')")
    common = [*gpt_args(tmp_path / "corpus"), *GPU, f"parallelism={parallelism}",
              "model.n_embd=128", "compile=true"]  # fmt: skip
    float8 = cli(*common, "precision=float8", "precision.auto_filter=false",
                 f"precision.recipe={recipe}", name="float8", timeout=600)  # fmt: skip
    if torch.cuda.get_device_capability() < (8, 9):
        assert float8.returncode == 2, float8.output
        assert "compute capability 8.9 or newer" in float8.output
        return
    check_trained(float8)
    assert "linear layers converted" in float8.rank_log(0)
    bf16 = cli(*common, "precision=bf16", name="bf16", timeout=600)
    check_trained(bf16)
    a = [r["train/loss"] for r in float8.metrics()]
    b = [r["train/loss"] for r in bf16.metrics()]
    assert a == pytest.approx(b, rel=0.05)
    weights = torch.load(float8.run_dir / "model.pt", weights_only=True)
    assert all(w.dtype == torch.float32 for w in weights.values())


def test_cuda_graphs_train_what_the_default_mode_trains(cli, tmp_path):
    """compile.mode=reduce-overhead under ddp (the forward and backward replayed as CUDA
    graphs, with gradient accumulation and evaluation between): the losses of the default
    mode, no host sync on a quiet step."""
    common = [*gpt_args(tmp_path / "corpus"), *GPU, "precision=bf16", "grad_accum=2",
              "eval_interval=10", "sync_debug=error"]  # fmt: skip
    graphs = cli(*common, "compile={mode:reduce-overhead}", name="graphs", timeout=600)
    check_trained(graphs)
    default = cli(*common, "compile=true", name="default", timeout=600)
    check_trained(default)
    a = [r["train/loss"] for r in graphs.metrics() if "train/loss" in r]
    b = [r["train/loss"] for r in default.metrics() if "train/loss" in r]
    assert a == pytest.approx(b, rel=1e-2)


def test_batches_copied_ahead_train_what_batches_copied_in_step_train(cli, tmp_path):
    """input_prefetch (the next step's batches copied on a side stream) against copies in
    the step: the same weights, bit for bit; no host sync on a quiet step."""
    common = [*gpt_args(tmp_path / "corpus"), *GPU, "precision=bf16", "grad_accum=2",
              "sync_debug=error"]  # fmt: skip
    ahead = cli(*common, "input_prefetch=true", name="ahead")
    check_trained(ahead)
    inline = cli(*common, "input_prefetch=false", name="inline")
    check_trained(inline)
    assert same_weights(ahead.run_dir, inline.run_dir)


def test_a_text_batch_is_pinned_once_and_copied_once():
    """Text's input_ids and labels are one host tensor: pinned as one (in the collate, on a
    loader without workers) and copied to the device as one."""
    from runner.data.loaders import pinning
    from runner.train.step.batch_parts import to_device

    ids = torch.arange(64).reshape(4, 16)
    collate, dataloader_pins = pinning(lambda batch: batch[0], True, 0)
    host = collate([{"input_ids": ids, "labels": ids}])
    assert not dataloader_pins and host["input_ids"] is host["labels"]
    assert host["input_ids"].is_pinned()
    moved = to_device(host, "cuda")
    assert moved["input_ids"] is moved["labels"] and moved["labels"].is_cuda
