"""Heartbeats: each rank tells its node's agent how far it got, through shared memory.

The agent creates one file (in /dev/shm where there is one) with a slot per local rank and
names it in RUNNER_HEARTBEAT; a rank writes its slot at a few points of every step. A beat
is a store into a memory map: no system call, no collective, no wait for the device, so
the step path pays nothing measurable. The agent's watchdog (runner.launch.watchdog) reads
the slots and notices a rank whose slot stops changing.

Every rank beats in the same order (the same steps, microbatch loads and validation
batches), so the beat counts of two ranks say which one fell behind.
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
import time
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

ENV = "RUNNER_HEARTBEAT"
_SLOT = struct.Struct("<6qd")  # pid, global rank, attempt, phase, step, beats, time of the beat


class Phase(IntEnum):
    START = 1  # the process is up; no optimizer step finished yet
    BATCH = 2  # the step's batch is loaded: forward, backward, optimizer step
    STEP = 3  # the step finished: logging, then loading the next batch
    EVAL = 4  # evaluating (one beat per validation batch)
    SAVE = 5  # writing a checkpoint
    FINISH = 6  # gathering the weights, writing model.pt and summary.json


def describe(phase: int, step: int) -> str:
    """Where a rank was at its last beat, in words."""
    return {
        Phase.START: "starting up (no step finished yet)",
        Phase.BATCH: f"in step {step} (batch loaded: forward, backward or optimizer step)",
        Phase.STEP: f"after step {step} (logging or loading the next batch)",
        Phase.EVAL: f"evaluating after step {step}",
        Phase.SAVE: f"writing the checkpoint of step {step}",
        Phase.FINISH: f"finishing after step {step} (model.pt, summary.json)",
    }.get(phase, f"phase {phase} at step {step}")


@dataclass(frozen=True)
class Beat:
    """One slot as the agent reads it."""

    pid: int
    rank: int
    attempt: int
    phase: int
    step: int
    beats: int
    at: float  # the rank's time.time(): comparable across nodes (as far as their clocks are)


def create(slots: int) -> Path:
    """The agent's side: a zeroed file of `slots` slots, in memory where the OS offers it."""
    where = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    fd, name = tempfile.mkstemp(prefix="runner-heartbeat-", dir=where)
    os.write(fd, bytes(_SLOT.size * slots))
    os.close(fd)
    return Path(name)


def read(path: Path, slots: int) -> list[Beat]:
    data = path.read_bytes()
    return [Beat(*_SLOT.unpack_from(data, i * _SLOT.size)) for i in range(slots)]


class Heartbeat:
    """A rank's side. Without RUNNER_HEARTBEAT (a trainer built in a test) it does nothing."""

    def __init__(self, path: str | None, local_rank: int, rank: int, attempt: int):
        self._map: mmap.mmap | None = None
        self._offset = local_rank * _SLOT.size
        self._head = (os.getpid(), rank, attempt)
        self.step = 0
        self.beats = 0
        if path:
            with open(path, "r+b") as file:
                self._map = mmap.mmap(file.fileno(), 0)
            self.beat(Phase.START)

    @classmethod
    def from_env(cls) -> Heartbeat:
        env = os.environ
        return cls(
            env.get(ENV),
            int(env.get("LOCAL_RANK", "0")),
            int(env.get("RANK", "0")),
            int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
        )

    def beat(self, phase: Phase, step: int | None = None) -> None:
        if step is not None:
            self.step = step
        self.beats += 1
        if self._map is not None:
            head, step, beats = self._head, self.step, self.beats
            _SLOT.pack_into(self._map, self._offset, *head, phase, step, beats, time.time())
