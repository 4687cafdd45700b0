"""Giving freed host memory back to the operating system: once after building
(`give_back_freed_memory`), and, on a CPU rank of fsdp or ZeRO, every large block as it
is freed (`map_large_blocks_alone`).

glibc's malloc keeps what a process frees in its heap for the next allocation, and only
returns the free space at the heap's top. Building a sharded model frees much and keeps
little: zero.Init builds each module whole before it partitions it, DeepSpeed copies the
partitions into one flat buffer, FSDP2 shards what it was given. The holes stay resident,
and a rank's resident memory is its high-water mark plus those holes. `malloc_trim(0)`
hands every free page back (the pages inside holes too), at the cost of faulting them in
again when they are next used: worth it once, after building, before the first step. (Each
step too was tried: the training step's own holes come back within the next step.)
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable, Mapping


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim  # the C library already loaded; glibc only

    except (OSError, AttributeError):
        return None


def give_back_freed_memory() -> bool:
    """Return the heap's free pages to the system; False where the C library cannot."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


MMAP_THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc's own variable; a set one is the user's
LARGE_BLOCK = 1 << 20
EXCHANGED_BLOCK = 1 << 18
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def large_block(
    parallelism: str, device: str, environ: Mapping[str, str], exchanges_tokens: bool = False
) -> int | None:
    """The size from which a rank maps every block on its own (glibc's mmap threshold), or
    None where glibc is left as it runs: a CPU rank of an engine that allocates and frees
    large blocks on every step (fsdp, zero1/2/3), where the user did not set
    MALLOC_MMAP_THRESHOLD_. LARGE_BLOCK; EXCHANGED_BLOCK where the rank sends tokens to the
    ranks of its experts and back (expert parallelism).

    A sharded rank (fsdp, zero3) gathers each block's whole weights for its forward and
    backward passes and frees them after; DeepSpeed's zero1 and zero2 build their gradient
    buckets and flat partitions anew each step. glibc keeps freed blocks in its heap (its
    mmap threshold grows to the largest block freed, up to 32 MB), and the next step's
    blocks of other sizes fit its holes badly: a 24x1024 gpt under fsdp at nproc=4 held
    1.3x the whole model per rank after one step, against 0.1x with the threshold at 1 MB;
    a 4x384 gpt under zero2 grew from some 300 MB above its base after 4 steps to 500-600
    MB after 24, and holds 185 MB from the first step to the last at 1 MB. Under expert
    parallelism the exchanged tokens' buffers (a few hundred KB each) change size every
    pass, and holes below 1 MB grew too: gpt_moe_text under fsdp expert=2 at nproc=2 held
    140-180 MB above its base after 12 steps, growing, and 45-47 MB from the first step to
    the last at 256 KB (its step 0.19 s against 0.15 s: the fresh pages' faults). A block
    mapped alone goes back to the system when freed; the price is its page faults (not
    measurable against a step at 1 MB), which a GPU rank does not pay (its blocks are
    device memory). ddp holds the same tensors step after step, and is left as glibc runs
    it."""
    frees_large_blocks = parallelism in ("fsdp", "zero1", "zero2", "zero3")
    if not (frees_large_blocks and device == "cpu") or MMAP_THRESHOLD_ENV in environ:
        return None
    return EXCHANGED_BLOCK if exchanges_tokens else LARGE_BLOCK


def map_large_blocks_alone(size: int = LARGE_BLOCK) -> bool:
    """Set glibc's mmap threshold to `size` for what this process allocates from now on, as
    MALLOC_MMAP_THRESHOLD_=size would have at its start; False where the C library has no
    mallopt."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, size))
