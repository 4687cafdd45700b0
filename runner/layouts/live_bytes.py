"""The bytes of tensors alive at once, and the FLOPs, counted as operations run on fake
tensors.

Under torch's FakeTensorMode a model runs with no memory and no arithmetic: every tensor has
its shape, dtype and a storage of its size, nothing behind it. `LiveBytes` watches each
operation's outputs and counts each new storage until Python lets it go (a weak reference:
autograd frees a saved activation when backward no longer needs it, and the count falls as
it would on a device). `peak` is the most counted at once since the last `reset`: what an
allocator would have had to hand out for the tensors made in between, nothing for the
tensors that existed before (the parameters, their gradients, the optimizer's state).
While `inside` is above 0 (`within(module)` counts a module's forward) what is made is
counted apart as well: `peak_inside` is how much of `peak` was made there.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry


class LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.peak = 0
        self.flops = 0
        self.ops = 0  # operations run
        self._ids: set[int] = set()
        self.inside = 0  # forwards of the watched modules running now
        self.now_inside = 0
        self.peak_inside = 0  # of `peak`, what was made inside them

    def reset(self) -> None:
        """Count the peak from what is alive now."""
        self.peak, self.peak_inside = self.now, self.now_inside

    def within(self, module: Any) -> None:
        """Count what `module`'s forward makes apart too (its forward hooks)."""

        def enter(*_: Any) -> None:
            self.inside += 1

        def leave(*_: Any) -> None:
            self.inside -= 1

        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        count = flop_registry.get(func._overloadpacket)
        if count is not None:
            self.flops += count(*args, **kwargs, out_val=out)
        inputs = tree_flatten((args, kwargs))[0]
        given = {id(t.untyped_storage()) for t in inputs if isinstance(t, torch.Tensor)}
        for value in tree_flatten(out)[0]:  # a view or an in-place result makes nothing new
            if isinstance(value, torch.Tensor) and id(value.untyped_storage()) not in given:
                self._count(value)
        if self.now > self.peak:
            self.peak, self.peak_inside = self.now, self.now_inside
        return out

    def _count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._ids:
            return
        size = storage.nbytes()
        self._ids.add(key)
        self.now += size
        inside = size if self.inside > 0 else 0
        self.now_inside += inside
        weakref.finalize(storage, self._free, key, size, inside)

    def _free(self, key: int, size: int, inside: int = 0) -> None:
        self._ids.discard(key)
        self.now -= size
        self.now_inside -= inside
