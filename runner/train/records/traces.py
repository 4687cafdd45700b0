"""`profile`: torch.profiler traces of chosen optimizer steps, and CUDA memory snapshots, in
the run directory's profile/.

Each run of consecutive steps in `profile.steps` is one trace, from the moment its first
step draws its batch to the end of its last (its evaluation and checkpoint included, when
the step has them), every step marked `step N` in it: `rank{R}.steps_{a}-{b}.pt.trace.json`,
which Perfetto (ui.perfetto.dev) and TensorBoard's profiler plugin open. On CUDA the trace
holds the device's kernels beside the host's ops. With `profile.memory` (CUDA), the
allocator's history is recorded from the start, and a snapshot is written at the end of each
traced run of steps (`rank{R}.steps_{a}-{b}.memory.pickle`) and when memory runs out
(`rank{R}.out_of_memory.memory.pickle`): pytorch.org/memory_viz draws them. Files are
written under a temporary name and renamed: one that is there is whole.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from runner.spec.device_specs import ProfileSpec

log = logging.getLogger(__name__)
HISTORY_ENTRIES = 100_000  # allocator events a memory snapshot keeps


def step_runs(steps: tuple[int, ...]) -> list[tuple[int, int]]:
    """The runs of consecutive steps, (first, last) each: [3, 4, 5, 9] -> [(3, 5), (9, 9)]."""
    runs: list[tuple[int, int]] = []
    for step in sorted(set(steps)):
        if runs and step == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], step)
        else:
            runs.append((step, step))
    return runs


class StepTraces:
    def __init__(
        self,
        options: ProfileSpec,
        root: Path,
        rank: int,
        device: str,
        total_steps: int,
        say: Callable[[str], None] = log.warning,
    ):
        """`total_steps`: the steps the run takes (max_epochs' too, which the config cannot
        know); steps beyond them are said (`say`: rank 0's terminal) and not traced."""
        self.rank = rank
        on = options.traces(rank)
        self.runs = step_runs(options.steps) if on else []
        beyond = sorted(s for s in set(options.steps) if s > total_steps)
        if beyond and rank == 0:
            say(f"profile.steps: {beyond} beyond this run's {total_steps} steps: not traced")
        self.cuda = torch.device(device).type == "cuda"
        self.memory = on and options.memory and self.cuda
        self.dir = root / "profile"
        self._profiler: Any = None
        self._scope: Any = None  # the current step's record_function
        self._run: tuple[int, int] | None = None
        if self.memory:  # from the start: a snapshot shows how memory came to be where it is
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)

    def before(self, step: int) -> None:
        """Step `step` is about to draw its batch."""
        if self._profiler is None:
            found = next((r for r in self.runs if r[0] == step), None)
            if found is None:
                return
            self._start(found)
        self._leave_step()  # a rollback left its step open
        self._scope = torch.profiler.record_function(f"step {step}")
        self._scope.__enter__()

    def after(self, step: int) -> float:
        """Step `step` is done (and its evaluation and checkpoint, if it has them). Returns
        the seconds spent writing a trace (not training: the records leave them out)."""
        if self._profiler is None:
            return 0.0
        self._leave_step()
        assert self._run is not None
        if step < self._run[1]:
            return 0.0
        started = time.perf_counter()
        self._finish()
        return time.perf_counter() - started

    def out_of_memory(self) -> None:
        """Memory ran out: the snapshot of how it came to that (profile.memory)."""
        if self.memory:
            self._snapshot(f"rank{self.rank}.out_of_memory.memory.pickle")

    def close(self) -> None:
        """The run ended inside a traced run of steps: what was traced is written."""
        if self._profiler is not None:
            self._leave_step()
            self._finish()

    def _start(self, run: tuple[int, int]) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._profiler = profile(activities=activities, record_shapes=True, profile_memory=True)
        self._profiler.__enter__()
        self._run = run

    def _leave_step(self) -> None:
        if self._scope is not None:
            self._scope.__exit__(None, None, None)
            self._scope = None

    def _finish(self) -> None:
        assert self._run is not None
        first, last = self._run
        name = f"rank{self.rank}.steps_{first}-{last}"  # one step: steps_9-9
        profiler, self._profiler, self._run = self._profiler, None, None
        profiler.__exit__(None, None, None)
        self.dir.mkdir(exist_ok=True)
        self._written(f"{name}.pt.trace.json", profiler.export_chrome_trace)
        trace = self.dir / f"{name}.pt.trace.json"
        log.info("profile: steps %d-%d traced into %s", first, last, trace)
        if self.memory:
            self._snapshot(f"{name}.memory.pickle")

    def _snapshot(self, name: str) -> None:
        self.dir.mkdir(exist_ok=True)
        self._written(name, torch.cuda.memory._dump_snapshot)

    def _written(self, name: str, write: Any) -> None:
        """`write(path)` into a temporary name, then renamed: a file there is whole."""
        final = self.dir / name
        partial = self.dir / f".{name}.partial"
        try:
            write(str(partial))
            os.replace(partial, final)
        except Exception as exc:  # a trace never takes the run down
            log.warning("profile: %s not written: %s", final, exc)
            with contextlib.suppress(OSError):
                partial.unlink()
