"""The planner's forked jobs (runner.layouts.forked): the serial answer, in order, from
children that each do a share; a child that fails has its share done again in the parent."""

from __future__ import annotations

import os

import pytest

from runner.layouts.forked import forked_map


def test_the_answers_are_the_serial_ones_in_order() -> None:
    jobs = list(range(11))
    assert forked_map(lambda n: (n * n, os.getpid()), jobs, 1) == [
        (n * n, os.getpid()) for n in jobs
    ]
    answers = forked_map(lambda n: (n * n, os.getpid()), jobs, 3)
    assert [a for a, _ in answers] == [n * n for n in jobs]
    assert len({pid for _, pid in answers}) == 3  # the parent and two children


def test_a_child_that_fails_has_its_share_done_again_here() -> None:
    parent = os.getpid()

    def only_here(n: int) -> int:
        if os.getpid() != parent:
            raise RuntimeError("a child that fails")
        return n + 1

    assert forked_map(only_here, [1, 2, 3, 4], 2) == [2, 3, 4, 5]


def test_an_error_of_the_work_itself_is_raised() -> None:
    def broken(n: int) -> int:
        raise ValueError(f"job {n}")

    with pytest.raises(ValueError, match="job 0"):
        forked_map(broken, [0, 1], 2)


@pytest.mark.slow
def test_a_child_runs_torch_after_the_parent_used_its_threads() -> None:
    """OpenMP's threads are not in a fork: a child's parallel region would wait for them
    forever, unless it runs on one thread (the planner's resolution hung so, building a
    dataset in a child after the parent had timed a matrix product). In a process of its
    own, so that a hang fails the test."""
    import subprocess
    import sys

    script = """
import torch
from runner.layouts.forked import forked_map
torch.set_num_threads(2)
torch.randn(512, 512) @ torch.randn(512, 512)  # the parent's pool is up
def parallel(n):
    return float(torch.nn.functional.interpolate(torch.ones(1, 3, 256, 256), size=512).sum())
assert forked_map(parallel, [0, 1, 2, 3], 2) == [3 * 512 * 512.0] * 4
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
