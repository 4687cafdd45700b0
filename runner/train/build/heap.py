"""Giving freed host memory back to the operating system.

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
from collections.abc import Callable


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
