"""Ranks of a test's own distributed code (a worker function of the test module, over gloo):
forks of one server per test process that imported torch once, not a new interpreter per
rank that imports it again (2-3 s of CPU each here).

multiprocessing's forkserver: started the first time a test asks, from the test process as
it is then (its environment: tests/conftest.py's ONE_THREAD), and kept until the process
ends; each rank is a fork of it that imports the test module, as a spawned one would. The
cost ledger (tests/helpers/cost.py) reads the server's CPU seconds and its ranks' as they
accrue (they are not the test process's children)."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

# What every such rank imports before its test module's own imports. The server is one per
# process, and its preload is whoever started it first: nothing else sets one (a rank that
# must run without MLflow, test_zero_fp16's, would otherwise find it imported).
PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch._dynamo"]


def start_ranks(worker: Callable[..., Any], args: tuple, nprocs: int) -> None:
    """torch.multiprocessing.spawn(worker, args, nprocs, join=True), the ranks forked from
    the server: `worker(rank, *args)` on each; a rank's exception is raised here."""
    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    mp.start_processes(worker, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def in_a_fresh_fork(function: Callable[..., Any], *args: Any) -> Any:
    """`function(*args)` in a fork of that server, its result pickled back: for code that
    forks in turn (the planner's forked_map), which a test process that has run autograd's
    threads cannot do ("Unable to handle autograd's threading in combination with
    fork-based multiprocessing", as a fresh clone's make test met it)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    with context.Pool(1) as pool:
        return pool.apply(function, args)
