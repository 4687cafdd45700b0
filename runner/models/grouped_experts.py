"""The experts' two-layer GELU MLPs over tokens sorted by expert: torch's grouped matrix
product where torch has one for the device (CUDA from Hopper in bf16; the CPU in recent
releases), else a loop over the experts (runner.models.moe's Experts).

Whether the CPU's grouped product works is tried once per dtype on a few numbers, outside
any trace: a torch without it raises. A trace on fake or meta tensors (the layout planner's)
runs the product's meta kernel instead, which some releases (2.11) hold to bf16 where the
CPU kernel takes fp32: tried the same way, and such a trace takes the loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CPU_GROUPED: dict[torch.dtype, bool] = {}  # whether the CPU's grouped product works, per dtype
_META_GROUPED: dict[torch.dtype, bool] = {}  # whether its meta kernel takes the dtype


def expert_mlps(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """`x`: tokens sorted by expert, `counts[e]` of them for expert e, through each expert's
    `w1` [n_embd, hidden], GELU and `w2` [hidden, n_embd] (stacked by expert)."""
    if grouped(x, w1):
        offsets = counts.cumsum(0).to(torch.int32)
        dtype = _compute_dtype(x)
        hidden = torch._grouped_mm(x.to(dtype), w1.to(dtype), offs=offsets)
        return torch._grouped_mm(F.gelu(hidden), w2.to(dtype), offs=offsets)
    return expert_loop(x, counts, w1, w2)


@torch.compiler.disable
def expert_loop(
    x: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Each expert on its tokens in turn. The split sizes are read on the host, and they
    change every pass: left out of torch.compile's graphs, which would recompile for each."""
    pieces = x.split(_sizes(counts, x.shape[0]))
    outputs = [
        F.gelu(piece @ a) @ b
        for piece, a, b in zip(pieces, w1.unbind(0), w2.unbind(0), strict=True)
    ]
    return torch.cat(outputs) if outputs else x[:0]


def _traced(x: torch.Tensor) -> bool:
    """Whether `x` holds no values: a fake or meta tensor (a trace)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor) or x.device.type == "meta"


def _sizes(counts: torch.Tensor, total: int) -> list[int]:
    """`counts` on the host; where it holds no values (a trace on fake or meta tensors, as
    the layout planner runs one), an even split of the `total`."""
    if _traced(counts):
        share, extra = divmod(total, counts.numel())
        return [share + (i < extra) for i in range(counts.numel())]
    return counts.tolist()


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def grouped(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch's grouped matrix product runs here: on a CPU where this torch has one
    (forward and backward, in the compute dtype; in a trace, where its meta kernel takes the
    dtype too); on CUDA at compute capability 9 or more (Hopper), in bf16, on a torch that
    has it."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        dtype = _compute_dtype(x)
        aligned = all(n * dtype.itemsize % 16 == 0 for n in weight.shape[1:])  # its strides
        works = grouped_on_cpu(dtype) and (not _traced(x) or _probe(_META_GROUPED, dtype, "meta"))
        return aligned and works
    if x.device.type != "cuda":
        return False
    if _compute_dtype(x) != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(x.device)[0] >= 9


def probe_grouped() -> None:
    """Try the grouped product for every dtype now, outside any trace or fake mode (Experts
    does as it is built), so that torch.compile reads a known answer."""
    if hasattr(torch, "_grouped_mm"):
        for dtype in _DTYPES:
            grouped_on_cpu(dtype)
            _probe(_META_GROUPED, dtype, "meta")


def grouped_on_cpu(dtype: torch.dtype) -> bool:
    """Whether this torch multiplies grouped matrices on the CPU in `dtype`, with their
    gradients (rows whose strides are multiples of 16 bytes)."""
    return _probe(_CPU_GROUPED, dtype, "cpu")


def _probe(known: dict[torch.dtype, bool], dtype: torch.dtype, device: str) -> bool:
    if dtype not in known:
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            known[dtype] = _try_grouped(dtype, device)
    return known[dtype]


def _try_grouped(dtype: torch.dtype, device: str) -> bool:
    try:
        x = torch.ones(3, 8, dtype=dtype, device=device, requires_grad=True)
        weight = torch.ones(2, 8, 8, dtype=dtype, device=device, requires_grad=True)
        offsets = torch.tensor([1, 3], dtype=torch.int32, device=device)
        out = torch._grouped_mm(x, weight, offs=offsets)
        out.backward(torch.ones_like(out))
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    if device == "meta":
        return x.grad is not None and x.grad.shape == x.shape
    return x.grad is not None and bool((x.grad == 8).all())
