"""The figures of a log record that LLM users read: FLOPs per token (MFU's numerator),
the GPU peak table (its denominator), and which peak a run uses."""

from __future__ import annotations

import dataclasses

import pytest
from torch import nn

from runner.hardware import PEAK_TFLOPS, gpu_row, peak_tflops
from runner.models.gpt import GPT
from runner.spec import resolve_spec
from runner.train.records.step_figures import StepFigures, device_peak_flops, flops_per_token
from tests.helpers.config import compose_config


def test_gpt_flops_per_token_against_a_hand_count() -> None:
    vocab, context, layers, width = 300, 64, 3, 48
    model = GPT(vocab, context, n_layer=layers, n_head=4, n_embd=width, bias=False)
    # Per layer: qkv 3w^2, attention output w^2, MLP 4w^2 + 4w^2, two LayerNorm weights w;
    # then the last LayerNorm w and the head w x vocab. The embeddings only look up.
    dense = layers * (12 * width**2 + 2 * width) + width + width * vocab
    attention = layers * 2 * (2 * context * width)  # scores and weighted sum, forward
    hand = 6 * dense + 3 * attention  # forward 2 per multiply, backward twice the forward
    assert flops_per_token(model) == hand
    assert dense == sum(p.numel() for p in model.parameters()) - (vocab + context) * width


def test_a_model_without_its_own_count_is_six_per_multiplying_parameter() -> None:
    model = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 50))
    assert flops_per_token(model) == 6 * (8 * 50 + 50)


@pytest.mark.parametrize(
    ("name", "row"),
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", "H100 NVL"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA A10G", None),  # not the A10's figures
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L4", "L4"),
        ("Tesla V100-SXM2-16GB", "V100"),
        ("AMD Instinct MI300X", None),
    ],
)
def test_gpu_names_find_their_row(name: str, row: str | None) -> None:
    assert gpu_row(name) == row


def test_the_table_has_a_peak_per_precision() -> None:
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert peak_tflops("V100", "bf16") is None  # none in hardware
    assert all(set(row) <= {"bf16", "fp16", "fp32"} for row in PEAK_TFLOPS.values())
    assert all(row["bf16"] > row["fp32"] for row in PEAK_TFLOPS.values() if "bf16" in row)


def test_the_peak_a_run_uses() -> None:
    spec = resolve_spec(compose_config(["device=cpu"]))
    assert device_peak_flops(spec, "cpu") is None  # no MFU on a CPU unless declared
    declared = dataclasses.replace(spec, mfu=dataclasses.replace(spec.mfu, peak_tflops=0.5))
    assert device_peak_flops(declared, "cpu") == 0.5e12


def test_mfu_is_tokens_per_second_times_flops_over_the_peak_of_every_rank() -> None:
    spec = resolve_spec(compose_config(["device=cpu", "mfu.peak_tflops=2"]))
    figures = StepFigures(spec, "cpu", samples=0, flops=1e6, world=4)
    record: dict = {}
    figures.complete(record, elapsed=2.0, sums=(4e6, 9.0), peak_mb=100.0)
    assert record["throughput/tokens_per_sec"] == 2e6
    assert record["throughput/mfu"] == pytest.approx(2e6 * 1e6 / (4 * 2e12))
    assert record["train/grad_norm"] == 3.0 and record["memory/peak_mb"] == 100.0
    samples_only = StepFigures(spec, "cpu", samples=0, flops=None, world=4)
    record = {}
    samples_only.complete(record, elapsed=2.0, sums=(0.0, -1.0), peak_mb=100.0)
    assert record == {"memory/peak_mb": 100.0}  # no tokens, no norm measured


def test_the_first_step_is_left_out_of_the_throughput_unless_it_is_logged() -> None:
    """The first step compiles and warms up: the first record counts the steps after it."""
    import time

    spec = resolve_spec(compose_config(["device=cpu"]))
    figures = StepFigures(spec, "cpu", samples=0, flops=1.0, world=1)
    figures.add_tokens(100)
    time.sleep(0.2)  # a slow first step
    figures.step_done(samples=8, logged=False)
    figures.add_tokens(100)
    figures.step_done(samples=16, logged=False)
    fields, elapsed, tokens = figures.take(samples=16)
    assert tokens == 100 and elapsed < 0.2
    assert fields["throughput/samples_per_sec"] == pytest.approx(8 / elapsed)
    logged_first = StepFigures(spec, "cpu", samples=0, flops=1.0, world=1)
    logged_first.add_tokens(100)
    logged_first.step_done(samples=8, logged=True)  # log_interval=1: the only span there is
    assert logged_first.take(samples=8)[2] == 100


def test_the_bar_says_whose_loss_it_shows() -> None:
    """The bar counts steps as they are taken; a record comes once its step's figures are
    reduced, steps later: the postfix names the record's step then (at 6/12 it had shown
    step 4's loss as if it were step 6's)."""
    import io

    from runner.train.records.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    progress = Progress(12, Terminal(), enabled=True)
    for _ in range(6):
        progress.advance()
    progress.logged({"step": 4, "train/loss": 2.5, "lr": 1e-3})
    assert progress.bar.postfix.startswith("step 4: loss 2.5000"), progress.bar.postfix
    progress.logged({"step": 6, "train/loss": 2.25, "lr": 1e-3})
    assert progress.bar.postfix.startswith("loss 2.2500"), progress.bar.postfix
    progress.close()
