"""A model's blocks, and activation checkpointing applied to them.

A block is the unit a model repeats: the layers of a transformer, the stages of a deep
network. Its family says which they are (runner.models.families); by default they are found
without help as the largest `nn.ModuleList` (or `nn.Sequential`) whose children all share
one class (the gpt model's `blocks`, a Hugging Face model's `h` or `layers`), or named by
class.

Activation checkpointing keeps only each checkpointed block's input during the forward
pass and recomputes the block in the backward pass: activation memory for compute. It
is non-reentrant (torch.utils.checkpoint with use_reentrant=False) and leaves the
module tree and state_dict keys as they were, so checkpoints and model.pt do not change.

Selective checkpointing decides per operation instead: it keeps the outputs of attention,
of the matrix products that come before attention in the block (its input projections:
qkv, or q, k and v) and of collectives, and recomputes everything else in the backward
pass: the norms, activations, dropout, and the products after attention (its output
projection, the MLP). Attention is the one operation whose recompute costs far more than
its output weighs (its output is one row of width per token; its cost grows with the
sequence); every linear layer costs alike per byte it keeps, so the policy keeps those that
attention's backward needs and drops the MLP's, the block's largest activations (its two
4x-wide tensors). On the gpt this keeps about three quarters of full checkpointing's saving
for a recompute of the block's products after attention (measured:
benchmarks/results/activation_checkpointing.md). torchtitan's policy keeps every other
product instead (the MLP's first layer too): half the saving, for less recompute where the
products dominate a step. A block with no attention keeps its products and recomputes the
rest. The policy runs inside torch.utils.checkpoint (`create_selective_checkpoint_contexts`),
per block, so it holds under every engine and under torch.compile.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint


def find_blocks(module: nn.Module, classes: Sequence[str] = ()) -> list[nn.Module]:
    """The model's blocks, in order: modules of the named classes, or else those its family
    declares (runner.models.families; by default the children of its largest list of
    modules of one class)."""
    if classes:
        wanted = set(classes)
        return [m for m in module.modules() if type(m).__name__ in wanted]
    from runner.models.families import family_of

    return family_of(module).blocks(module)


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _selectively_checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    attended = {False: False, True: False}  # attention run yet, in the forward and the recompute
    matmuls, kept = matrix_products(), kept_operations()
    attention = attention_operations() | softmaxes()  # a fused kernel, or the math path's

    def policy(ctx: Any, op: Any, *_: Any, **__: Any) -> Any:
        if op in attention:
            attended[ctx.is_recompute] = True
        keep = op in kept or (op in matmuls and not attended[ctx.is_recompute])
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    context = functools.partial(create_selective_checkpoint_contexts, policy)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)


@functools.cache
def _ignore_profiler_marks() -> None:
    """Leave record_function's marks out of selective checkpointing's bookkeeping (torch's
    SAC_IGNORED_OPS, the ops it runs as they come): it keeps each op with an effect, and
    FSDP's hooks of a module sharded on its own inside a block (the experts, under expert
    parallelism) mark the recompute differently from the forward pass, which SAC takes for
    a different computation. The marks compute nothing."""
    import torch
    from torch.utils import checkpoint as torch_checkpoint

    for name in ("_record_function_enter", "_record_function_enter_new", "_record_function_exit"):
        packet = getattr(torch.ops.profiler, name, None)
        for overload in packet.overloads() if packet is not None else []:
            torch_checkpoint.SAC_IGNORED_OPS.add(getattr(packet, overload))


def _ops(names: Sequence[tuple[str, str]]) -> frozenset[Any]:
    import torch

    found = set()
    for namespace, name in names:
        packet = getattr(getattr(torch.ops, namespace), name, None)
        if packet is not None:
            found.add(packet.default)
    return frozenset(found)


@functools.cache
def matrix_products() -> frozenset[Any]:
    return _ops([("aten", "mm"), ("aten", "addmm"), ("aten", "bmm"), ("aten", "baddbmm")])


@functools.cache
def attention_operations() -> frozenset[Any]:
    """Attention's kernels, each backend's, where this torch has them."""
    return _ops([
        ("aten", "_scaled_dot_product_flash_attention"),
        ("aten", "_scaled_dot_product_efficient_attention"),
        ("aten", "_scaled_dot_product_cudnn_attention"),
        ("aten", "_scaled_dot_product_flash_attention_for_cpu"),
    ])  # fmt: skip


@functools.cache
def softmaxes() -> frozenset[Any]:
    """Where attention without a fused kernel (the math path: dropout on CPU, a mask some
    kernels refuse) turns its scores into weights."""
    return _ops([("aten", "_softmax"), ("aten", "_safe_softmax")])


@functools.cache
def kept_operations() -> frozenset[Any]:
    """What selective checkpointing always keeps: attention and collectives (tensor
    parallelism's reductions)."""
    collectives = _ops([
        ("_c10d_functional", "reduce_scatter_tensor"),
        ("_c10d_functional", "all_reduce"),
        ("_c10d_functional", "all_gather_into_tensor"),
    ])  # fmt: skip
    return attention_operations() | collectives


def apply_activation_checkpointing(module: nn.Module, every: int, selective: bool = False) -> int:
    """Checkpoint every `every`-th block (1: all of them), or every block selectively (see
    the module's text). Returns how many were wrapped.

    Raises ValueError when the model has no blocks to checkpoint."""
    blocks = find_blocks(module)
    if not blocks:
        raise ValueError(
            f"activation_checkpointing: {type(module).__name__} has no blocks (a ModuleList "
            "of modules of one class) to checkpoint; use activation_checkpointing=none"
        )
    chosen = blocks[every - 1 :: every]
    wrapper = _selectively_checkpointed if selective else _checkpointed
    if selective:
        _ignore_profiler_marks()  # here, not in the forward: torch.compile may trace that
    for block in chosen:
        block.forward = functools.partial(wrapper, block.forward)
    return len(chosen)
