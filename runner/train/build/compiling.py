"""`compile`: torch.compile on the model, in place, before an engine wraps or shards it.

In place (`nn.Module.compile`) keeps the module tree and state_dict keys as they were, so
checkpoints and model.pt are those of an eager run. Per block (torchtitan's order): after
activation checkpointing has wrapped each block, before FSDP shards it. Whole model: under
DDP, dynamo's DDP optimizer splits the graph at DDP's bucket boundaries, so gradients are
still exchanged while the backward pass runs.

Compilation happens in the first forward and backward passes (and again on a recompile);
`CompileClock` adds up the wall time dynamo reports for it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from torch import nn

from runner.models.blocks import find_blocks
from runner.spec.schema import CompileSpec

BLOCKS_SHARE = 0.5  # per_block=null: per block when the blocks hold this share of the weights


def blocks_to_compile(module: nn.Module, options: CompileSpec) -> list[nn.Module]:
    """The blocks compiled one by one, or [] for the whole model."""
    if options.per_block is False:
        return []
    blocks = find_blocks(module)
    if options.per_block is True:
        if not blocks:
            raise ValueError(
                f"compile.per_block=true: {type(module).__name__} has no blocks (a ModuleList "
                f"of modules of one class); use {options.typed(per_block=False)}"
            )
        return blocks
    total = sum(p.numel() for p in module.parameters())
    in_blocks = sum(p.numel() for b in blocks for p in b.parameters())
    return blocks if total and in_blocks >= BLOCKS_SHARE * total else []


def compile_model(
    module: nn.Module, options: CompileSpec, memory_budget: float | None = None
) -> str:
    """Compile `module` in place; say what was compiled. `memory_budget`: the share of the
    activations the partitioner keeps (activation_memory_budget)."""
    import torch._dynamo
    import torch._functorch.config

    torch._dynamo.config.optimize_ddp = True  # DDP: one graph per bucket (a no-op elsewhere)
    if memory_budget is not None:
        torch._functorch.config.activation_memory_budget = memory_budget
    kwargs: dict[str, Any] = {
        "backend": options.backend,
        "fullgraph": options.fullgraph,
    }
    if options.backend == "inductor":
        kwargs["mode"] = options.mode
    blocks = blocks_to_compile(module, options)
    if blocks:
        # Blocks of one class share their compiled code: allow a recompile per block.
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, 2 * len(blocks))
        for block in blocks:
            compile_in_place(block, kwargs)
        return f"{len(blocks)} blocks ({type(blocks[0]).__name__}) compiled one by one"
    compile_in_place(module, kwargs)
    return f"the whole {type(module).__name__} compiled"


def compile_in_place(module: nn.Module, options: dict[str, Any]) -> None:
    """What `nn.Module.compile` does (the module's calls go through torch.compile), with
    dynamo starting at a frame of runner's own. Module.compile compiles `_call_impl`, a
    frame in torch.nn that dynamo skips, and counts on finding the module's forward below
    it; where that forward is torch's own too (nn.Sequential, nn.Linear) torch 2.11 found
    nothing to compile and ran the model eagerly, without a word (pytorch#150915, fixed in
    a later release). From this frame dynamo inlines both."""
    import torch

    def call(*args: Any, **kwargs: Any) -> Any:
        return module._call_impl(*args, **kwargs)

    module._compiled_call_impl = torch.compile(call, **options)


class CompileClock:
    """Wall seconds spent compiling (dynamo's start/end callbacks, nested ones once)."""

    def __init__(self) -> None:
        from torch._dynamo.callback import callback_handler

        self.seconds = 0.0
        self.compiles = 0
        self._started: float | None = None
        self._lock = threading.Lock()
        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)

    def _start(self, _: Any) -> None:
        with self._lock:
            self._started = time.perf_counter()

    def _end(self, _: Any) -> None:
        with self._lock:
            if self._started is not None:
                self.seconds += time.perf_counter() - self._started
                self.compiles += 1
                self._started = None
