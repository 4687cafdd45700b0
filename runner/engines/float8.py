"""precision=float8: torchao's float8 training. The linear layers that gain run their three
matmuls (output, input gradient, weight gradient) in float8, each operand scaled to fit
float8's range (`recipe`: one scale per tensor, `tensorwise`, or per row, `rowwise`);
everything else runs under bf16 autocast, and the weights and the optimizer stay fp32.

Which layers convert: an nn.Linear whose sizes float8's matmul takes (multiples of 16),
whose name holds none of `filter_fqns` (the head, by default: its logits feed the loss),
and, with `auto_filter`, that is large enough to gain (torchao's rule from its H100 tables;
a 768-wide layer does not). Under fsdp the tensorwise recipe gathers the weights in float8
(`fsdp_float8_all_gather`: half the bytes of bf16), their scales computed for every layer
in one pass after each optimizer step (a hook on the optimizer: `after_each_step`).

On CPU torchao emulates float8's matmuls (the operands cast to float8 and back): a run
there checks the numbers and the plumbing, not the speed.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from runner.hardware import float8_problem
from runner.spec.schema import PrecisionSpec

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    """torchao's import registers an enum with torch's pytree, which newer torch logs a
    deprecation warning for on every rank: not the user's to act on."""
    pytree = logging.getLogger("torch.utils._pytree")
    level = pytree.level
    pytree.setLevel(logging.ERROR)
    try:
        yield
    finally:
        pytree.setLevel(level)


def layer_filter(spec: PrecisionSpec) -> Callable[[nn.Module, str], bool]:
    """Whether torchao converts the module named `fqn` (see the module text)."""
    with _quiet_import():
        from torchao.float8 import _auto_filter_for_recipe

    sized = _auto_filter_for_recipe(spec.recipe, list(spec.filter_fqns))

    def converts(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or any(f in fqn for f in spec.filter_fqns):
            return False
        out_features, in_features = module.weight.shape
        if out_features % 16 or in_features % 16:  # float8's matmul takes multiples of 16
            return False
        return sized(module, fqn) if spec.auto_filter else True

    return converts


def convert(
    module: nn.Module,
    spec: PrecisionSpec,
    device_type: str,
    sharded: bool,
    say: Callable[[str], None] = log.warning,
) -> int:
    """Swap `module`'s convertible nn.Linear layers for torchao's Float8Linear, in place;
    the number converted. `sharded`: FSDP will shard the model (the tensorwise recipe then
    gathers the weights in float8). `say`: how a run that converts nothing tells the user."""
    import dataclasses

    with _quiet_import():
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if device_type == "cuda":  # preflight read nvidia-smi where it could
        import torch

        major, minor = torch.cuda.get_device_capability()
        problem = float8_problem([major + minor / 10])
        if problem:
            raise ValueError(problem)
    config = Float8LinearConfig.from_recipe_name(spec.recipe)
    gather = sharded and spec.recipe == "tensorwise" and spec.fsdp_float8_all_gather
    config = dataclasses.replace(
        config, emulate=device_type != "cuda", enable_fsdp_float8_all_gather=gather
    )
    converts = layer_filter(spec)
    linears = [name for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    chosen = [name for name, m in module.named_modules() if converts(m, name)]
    convert_to_float8_training(module, module_filter_fn=converts, config=config)
    kept = len(linears) - len(chosen)
    if not chosen:
        too_small = ", or too small to gain" if spec.auto_filter else ""
        say(
            f"precision=float8: none of the model's {len(linears)} linear layers converts "
            f"(filter_fqns={list(spec.filter_fqns)}{too_small}): this run computes in bf16; "
            "precision.auto_filter=false converts every layer whose sizes are multiples of 16"
        )
    log.info(
        "float8 (%s%s): %d of %d linear layers converted; %d stay bf16 (filter_fqns=%s%s)",
        spec.recipe,
        ", weights gathered in float8" if gather else "",
        len(chosen),
        len(linears),
        kept,
        list(spec.filter_fqns),
        ", or too small to gain: auto_filter" if spec.auto_filter else "",
    )
    return len(chosen)


def gathers_in_float8(module: nn.Module) -> bool:
    """Whether any layer of `module` has FSDP gather its weight in float8 (then its scale
    is best computed for all layers at once after each optimizer step)."""
    return any(
        getattr(getattr(m, "config", None), "enable_fsdp_float8_all_gather", False)
        for m in module.modules()
    )


def precompute_scales(module: nn.Module) -> None:
    """The float8 scales of every weight FSDP gathers in float8, in one pass (torchao)."""
    with _quiet_import():
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(module)


def after_each_step(optimizer: Any, module: nn.Module) -> None:
    """Where FSDP gathers weights in float8: their scales computed after every optimizer
    step, all at once (torchtitan's post-step hook), from the weights just stepped; and
    after a checkpoint loads the optimizer, from the weights loaded (loading may step the
    optimizer once before the weights arrive, to make its state: scales of the weights it
    replaced would be used otherwise)."""
    if gathers_in_float8(module):
        optimizer.register_step_post_hook(lambda *_: precompute_scales(module))
        optimizer.register_load_state_dict_post_hook(lambda *_: precompute_scales(module))
