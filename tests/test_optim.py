"""Optimizer groups, warmup in epochs and precision=auto: the selection logic."""

from __future__ import annotations

import pytest

from runner.engines.optim import LRSchedule, build_optimizer
from runner.hardware import auto_precision, cpu_has_native_bf16
from runner.models.builders import resnet18
from runner.spec import SpecError, resolve_spec
from runner.spec.schema import ConstantSpec, SGDSpec
from tests.helpers.config import compose_config


@pytest.mark.parametrize(
    ("device", "capabilities", "expected"),
    [
        ("cpu", [], "fp32"),  # without native bf16 (the flags test below)
        ("cuda", [8.0, 9.0], "bf16"),  # Ampere, Hopper
        ("cuda", [7.0], "fp16"),  # Volta
        ("cuda", [8.6, 7.5], "fp16"),  # mixed: the oldest decides
        ("cuda", [], "fp16"),  # unknown: fp16 runs everywhere
    ],
)
def test_auto_precision(device: str, capabilities: list[float], expected: str) -> None:
    assert auto_precision(device, capabilities) == expected


def test_cpu_bf16_only_where_the_cpu_has_it() -> None:
    avx2 = "flags\t\t: fpu sse sse2 avx avx2 fma\n"
    sapphire = "flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
    assert not cpu_has_native_bf16(avx2)
    assert cpu_has_native_bf16(sapphire)
    assert auto_precision("cpu", [], cpu_bf16=True) == "bf16"
    assert auto_precision("cpu", [], cpu_bf16=False) == "fp32"


def test_precision_auto_resolves_on_cpu() -> None:
    spec = resolve_spec(compose_config(["precision=auto", "device=cpu"]))
    assert spec.precision.name.value == ("bf16" if cpu_has_native_bf16() else "fp32")


def test_norm_layers_get_their_own_weight_decay() -> None:
    model = resnet18(num_classes=10, input_shape=(3, 32, 32))
    spec = SGDSpec(weight_decay=1e-4, norm_weight_decay=0.0)
    groups = build_optimizer(spec, model).param_groups
    assert [g["weight_decay"] for g in groups] == [1e-4, 0.0]
    bn = {id(p) for name, p in model.named_parameters() if "bn" in name or "downsample.1" in name}
    assert {id(p) for p in groups[1]["params"]} == bn
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    plain = build_optimizer(SGDSpec(weight_decay=1e-4), model).param_groups
    assert len(plain) == 1


def test_warmup_in_epochs_or_steps_not_both() -> None:
    with pytest.raises(SpecError) as info:
        resolve_spec(compose_config(["scheduler.warmup_epochs=2", "device=cpu"]))
    assert info.value.problems == [
        "scheduler.warmup_epochs=2.0: scheduler.warmup_steps=10 is set too; set one of them "
        "(scheduler.warmup_steps=0)"
    ]
    schedule = LRSchedule(ConstantSpec(warmup_steps=4), total_steps=10)
    assert [schedule(s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
