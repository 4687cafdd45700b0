"""Independent jobs of the planner run side by side in forked copies of its process: each
child inherits what the planner built (the fake model, its tracer) and sends back only its
result. No pickling of the work itself, and no second import of torch.

Used where the jobs touch no device (fake tensors on a CPU): a fork copies one thread, and
a CUDA context cannot be used in a forked child; a child runs torch's operations on one
thread.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from runner.processes import die_with_parent

T = TypeVar("T")
R = TypeVar("R")


def forked_map(work: Callable[[T], R], jobs: Sequence[T], workers: int) -> list[R]:
    """[work(job) for job in jobs], in up to `workers` processes at once: the jobs dealt
    round-robin, the first share done here, the others in forked children. A child that
    fails has its share done again here, so the result is the serial one's, or its error."""
    if workers < 2 or len(jobs) < 2 or not hasattr(os, "fork"):
        return [work(job) for job in jobs]
    shares = [list(range(len(jobs)))[k::workers] for k in range(min(workers, len(jobs)))]

    def share_of(indices: list[int]) -> Callable[[], list[R]]:
        return lambda: [work(jobs[i]) for i in indices]

    children = [(share, _fork(share_of(share))) for share in shares[1:]]
    results = dict(zip(shares[0], share_of(shares[0])(), strict=True))
    for share, child in children:
        answer = _read(*child) if child is not None else None
        values = answer[0] if answer is not None else share_of(share)()
        results.update(zip(share, values, strict=True))
    return [results[i] for i in range(len(jobs))]


def _fork(work: Callable[[], Any]) -> tuple[int, int] | None:
    """A child doing `work`: (its pid, the read end of its answer), or None."""
    try:
        reader, writer = os.pipe()
        pid = os.fork()
    except OSError:
        return None
    if pid:
        os.close(writer)
        return pid, reader
    # the child: do the work, send it, leave without running the parent's exit handlers
    os.close(reader)
    code = 1
    try:
        die_with_parent(signal.SIGKILL)
        _one_thread()
        payload = pickle.dumps((work(),))
        with os.fdopen(writer, "wb") as out:
            out.write(payload)
        code = 0
    finally:
        os._exit(code)


def _one_thread() -> None:
    """torch's operations in a child on its one thread: OpenMP's pool of the parent is not
    in the fork, and a parallel region would wait for its threads forever (a planner's
    child that built a dataset hung so)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def _read(pid: int, reader: int) -> tuple[Any] | None:
    """The child's (answer,), or None where it failed."""
    with os.fdopen(reader, "rb") as source:
        payload = source.read()
    _, status = os.waitpid(pid, 0)
    if status != 0 or not payload:
        return None
    try:
        return pickle.loads(payload)
    except Exception:  # a torn message: the share is done again
        return None
