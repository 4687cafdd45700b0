"""Optimizer groups, warmup in epochs and precision=auto: the selection logic."""

from __future__ import annotations

import pytest
import torch

from runner.engines.optim import build_optimizer
from runner.engines.schedules import build_scheduler
from runner.hardware import auto_precision, cpu_has_native_bf16
from runner.models.builders import resnet18
from runner.spec import SpecError, resolve_spec
from runner.spec.schema import OptimizerSpec, SchedulerSpec
from tests.helpers.config import compose_config


def sgd(**args: object) -> OptimizerSpec:
    norm = args.pop("norm_weight_decay", None)
    return OptimizerSpec(target="torch.optim.SGD", args={"lr": 0.1, **args}, norm_weight_decay=norm)


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
    spec = sgd(weight_decay=1e-4, norm_weight_decay=0.0)
    groups = build_optimizer(spec, model).param_groups
    assert [g["weight_decay"] for g in groups] == [1e-4, 0.0]
    bn = {id(p) for name, p in model.named_parameters() if "bn" in name or "downsample.1" in name}
    assert {id(p) for p in groups[1]["params"]} == bn
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    plain = build_optimizer(sgd(weight_decay=1e-4), model).param_groups
    assert len(plain) == 1


def test_warmup_in_epochs_or_steps_not_both() -> None:
    with pytest.raises(SpecError) as info:
        resolve_spec(compose_config(["scheduler.warmup_epochs=2", "device=cpu"]))
    assert info.value.problems == [
        "scheduler.warmup_epochs=2.0: scheduler.warmup_steps=10 is set too; set one of them "
        "(scheduler.warmup_steps=0)"
    ]
    optimizer = build_optimizer(sgd(lr=1.0), torch.nn.Linear(2, 2))
    schedule = build_scheduler(SchedulerSpec(warmup_steps=4), optimizer, total_steps=10)
    lrs = []
    for _ in range(5):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert lrs == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_weight_decay_exclusions_and_lr_multipliers_make_groups() -> None:
    from runner.models.gpt import GPT

    model = GPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    names = {id(p): n for n, p in model.named_parameters()}
    spec = OptimizerSpec(
        target="torch.optim.AdamW",
        args={"lr": 0.01, "weight_decay": 0.1},
        no_weight_decay=("bias", "norm", "embedding"),
        lr_multipliers={"blocks.0": 0.5, "blocks.*": 2.0},  # the first match wins
    )
    optimizer = build_optimizer(spec, model)
    by_name = {names[id(p)]: g for g in optimizer.param_groups for p in g["params"]}
    assert len(by_name) == len(names)  # every parameter once, tied ones too
    decayed = {n for n, g in by_name.items() if g["weight_decay"] == 0.1}
    assert decayed and all(n.endswith("weight") for n in decayed)
    assert not any("ln" in n or "emb" in n for n in decayed)
    for name, group in by_name.items():
        expected = 0.005 if name.startswith("blocks.0.") else 0.02 if "blocks." in name else 0.01
        assert group["lr"] == pytest.approx(expected), name
    assert optimizer.param_groups[0]["lr"] == 0.01  # the plain group first


def test_name_patterns_that_match_nothing_are_named() -> None:
    from runner.engines.optim import unmatched_patterns

    spec = OptimizerSpec(no_weight_decay=("bias", "hed"), lr_multipliers={"blocks.9": 2.0})
    names = ["head.weight", "head.bias", "blocks.0.attn.weight"]
    assert unmatched_patterns(spec, names) == [
        "optimizer.no_weight_decay: 'hed'",
        "optimizer.lr_multipliers: 'blocks.9'",
    ]


def test_warmup_runs_before_any_torch_scheduler_and_its_state_round_trips() -> None:
    spec = SchedulerSpec(
        target="torch.optim.lr_scheduler.StepLR", args={"step_size": 2}, warmup_steps=2
    )

    def lrs(schedule, optimizer, steps: int) -> list[float]:
        seen = []
        for _ in range(steps):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            schedule.step()
        return seen

    optimizer = build_optimizer(sgd(lr=1.0), torch.nn.Linear(2, 2))
    schedule = build_scheduler(spec, optimizer, total_steps=10)
    assert lrs(schedule, optimizer, 4) == [0.5, 1.0, 1.0, 1.0]
    state, optimizer_state = schedule.state_dict(), optimizer.state_dict()
    rest = lrs(schedule, optimizer, 4)
    assert rest == pytest.approx([0.1, 0.1, 0.01, 0.01])

    again = build_optimizer(sgd(lr=1.0), torch.nn.Linear(2, 2))
    resumed = build_scheduler(spec, again, total_steps=10)
    again.load_state_dict(optimizer_state)
    resumed.load_state_dict(state)
    assert lrs(resumed, again, 4) == rest


def test_cosine_decays_after_warmup_to_its_floor() -> None:
    spec = SchedulerSpec(
        target="runner.engines.schedules.cosine", args={"min_lr_ratio": 0.1}, warmup_steps=2
    )
    optimizer = build_optimizer(sgd(lr=1.0), torch.nn.Linear(2, 2))
    schedule = build_scheduler(spec, optimizer, total_steps=6)
    seen = []
    for _ in range(7):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert seen == pytest.approx([0.5, 1.0, 1.0, 0.8682, 0.55, 0.2318, 0.1], abs=1e-4)


def test_fused_kernels_where_every_parameter_is_on_a_gpu_and_the_config_leaves_it_open():
    """A GPU's parameters (fake ones here: no memory, no device needed) get torch's fused
    step where the optimizer has one; a CPU's, a choice the config made, or an optimizer
    without one keep torch's default."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from runner.engines.optim import fused_default

    with FakeTensorMode():
        on_gpu = [{"params": [torch.nn.Parameter(torch.empty(4, device="cuda"))]}]
    on_cpu = [{"params": [torch.nn.Parameter(torch.empty(4))]}]
    assert fused_default(OptimizerSpec("torch.optim.AdamW"), on_gpu) == {"fused": True}
    assert fused_default(OptimizerSpec("torch.optim.SGD", {"lr": 0.1}), on_gpu) == {"fused": True}
    assert fused_default(OptimizerSpec("torch.optim.AdamW"), on_cpu) == {}
    assert fused_default(OptimizerSpec("torch.optim.AdamW", {"foreach": True}), on_gpu) == {}
    assert fused_default(OptimizerSpec("torch.optim.AdamW", {"fused": False}), on_gpu) == {}
    assert fused_default(OptimizerSpec("torch.optim.Adafactor"), on_gpu) == {}
