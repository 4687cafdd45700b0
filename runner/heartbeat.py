"""Heartbeats: each rank tells its node's agent how far it got, through shared memory.

The agent creates one file (in /dev/shm where there is one) with a slot per local rank and
names it in RUNNER_HEARTBEAT; a rank writes its slot at a few points of every step. A beat
is a store into a memory map: no system call, no collective, no wait for the device, so
the step path pays nothing measurable. The agent's watchdog (runner.launch.watchdog) reads
the slots and notices a rank whose slot stops changing.

The file opens with a control block the agent writes and the ranks read at the end of every
step: a graceful stop (runner.launch.stopping). Reading it is a load from the same map.

Every rank beats in the same order (the same steps, microbatch loads and validation
batches), so the beat counts of two ranks say which one fell behind.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import signal
import struct
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

from runner.dist import get_attempt

ENV = "RUNNER_HEARTBEAT"
_SLOT = struct.Struct("<6qd")  # pid, global rank, attempt, phase, step, beats, time of the beat
# The control block, before the slots: a stop was asked (0/1); the step every rank stops
# after (0: not agreed yet).
_CONTROL = struct.Struct("<2q")
PAUSE_POLL_S = 0.005
# What asks for a graceful stop (runner.launch.stopping): SLURM's --signal, submitit's
# SIGUSR2. SLURM sends it to every process of a job; the parent relays it to the agent, the
# agent tells the ranks through the control block, and the ranks ignore the signal itself.
STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)
# The watchdog's request for a rank's Python stacks (faulthandler): not one of STOP_SIGNALS.
STACK_SIGNAL = signal.SIGRTMIN + 1


class Phase(IntEnum):
    START = 1  # the process is up; no optimizer step finished yet
    BATCH = 2  # the step's batch is loaded: forward, backward, optimizer step
    STEP = 3  # the step finished: logging, then loading the next batch
    EVAL = 4  # evaluating (one beat per validation batch)
    SAVE = 5  # writing a checkpoint
    FINISH = 6  # gathering the weights, writing model.pt and summary.json
    PAUSED = 7  # a stop was asked: waiting to learn after which step every rank stops
    STOPPED = 8  # stopped as asked, after its checkpoint: closing its metrics, exiting


def describe(phase: int, step: int) -> str:
    """Where a rank was at its last beat, in words."""
    return {
        Phase.START: "starting up (no step finished yet)",
        Phase.BATCH: f"in step {step} (batch loaded: forward, backward or optimizer step)",
        Phase.STEP: f"after step {step} (logging or loading the next batch)",
        Phase.EVAL: f"evaluating after step {step}",
        Phase.SAVE: f"writing the checkpoint of step {step}",
        Phase.FINISH: f"finishing after step {step} (model.pt, summary.json)",
        Phase.PAUSED: f"paused after step {step} (a stop was asked; agreeing where)",
        Phase.STOPPED: f"stopped after step {step} as asked",
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
    """The agent's side: a zeroed file of `slots` slots, in memory where the OS offers it.

    Its name carries the agent's pid (and pid namespace), so that a file an agent could not
    remove (killed by SIGKILL) is removed by the next agent on the machine, or at once by
    the `runner` that started it (sweep_stale)."""
    where = _directory()
    sweep_stale()
    fd, name = tempfile.mkstemp(prefix=f"{_owner_prefix(os.getpid())}-", dir=where)
    os.write(fd, bytes(_CONTROL.size + _SLOT.size * slots))
    os.close(fd)
    return Path(name)


_PREFIX = "runner-heartbeat-"


def _directory() -> str:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _namespace() -> str:
    """This process's pid namespace (containers sharing /dev/shm may not share pids)."""
    try:
        return os.readlink("/proc/self/ns/pid").partition("[")[2].rstrip("]") or "0"
    except OSError:
        return "0"


def _owner_prefix(pid: int) -> str:
    return f"{_PREFIX}{_namespace()}-{pid}"


def sweep_stale(pid: int | None = None) -> list[Path]:
    """Remove the heartbeat files whose agent is gone: every such file of this pid namespace,
    or only agent `pid`'s. An agent removes its own when it ends; one killed by SIGKILL
    cannot, and /dev/shm is memory that outlives every process."""
    owners = f"{_owner_prefix(pid)}-*" if pid is not None else f"{_PREFIX}{_namespace()}-*-*"
    removed = []
    for path in Path(_directory()).glob(owners):
        owner = path.name.removeprefix(f"{_PREFIX}{_namespace()}-").partition("-")[0]
        if owner.isdigit() and not _alive(int(owner)):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def files() -> list[Path]:
    """Every agent's heartbeat file on this machine (this pid namespace's)."""
    return sorted(Path(_directory()).glob(f"{_PREFIX}{_namespace()}-*-*"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def read(path: Path, slots: int) -> list[Beat]:
    """The first `slots` ranks' beats, as many as the file holds (another agent's file, of
    fewer ranks, holds fewer)."""
    data = path.read_bytes()
    held = max(0, (len(data) - _CONTROL.size) // _SLOT.size)
    return [Beat(*_SLOT.unpack_from(data, _slot_offset(i))) for i in range(min(slots, held))]


def _slot_offset(local_rank: int) -> int:
    return _CONTROL.size + local_rank * _SLOT.size


def request_stop(path: Path) -> None:
    """Ask this node's ranks to pause at the end of their current step (the agent's side)."""
    _write_control(path, 0, 1)


def set_stop_step(path: Path, step: int) -> None:
    """Tell this node's ranks the step every rank of the run stops after."""
    _write_control(path, 8, step)


def _write_control(path: Path, offset: int, value: int) -> None:
    with open(path, "r+b") as file:
        file.seek(offset)
        file.write(struct.pack("<q", value))


def stopped(path: Path, slots: int) -> bool:
    """Whether this node's ranks ended by stopping as asked (not by finishing the run)."""
    return any(beat.phase == Phase.STOPPED for beat in read(path, slots))


def finished_step(path: Path, slots: int) -> int | None:
    """The last step every started rank of this node has finished (None: none started):
    where a run stopped by a signal stands, whatever its last logged step."""
    done = [
        beat.step - 1 if beat.phase == Phase.BATCH else beat.step
        for beat in read(path, slots)
        if beat.pid != 0
    ]
    return min(done) if done else None


def finished_step_of(agent: int) -> int | None:
    """finished_step of the file agent `agent` left (killed: it could not remove it), every
    slot it holds; None: no such file, or no rank started."""
    for path in Path(_directory()).glob(f"{_owner_prefix(agent)}-*"):
        with contextlib.suppress(OSError):
            return finished_step(path, 1 << 16)
    return None


def reachable_step(path: Path, slots: int) -> int:
    """After request_stop: the last step a rank of this node can finish before it sees the
    request and pauses. A rank checks at the end of every step, so it is the step it is in,
    or the next one when it is between steps (it may have checked just before the request)."""
    furthest = 0
    for beat in read(path, slots):
        if beat.pid == 0:
            continue  # not started: no step of this attempt yet (another rank bounds it)
        inside = beat.phase in (Phase.BATCH, Phase.PAUSED)
        furthest = max(furthest, beat.step if inside else beat.step + 1)
    return furthest


class Heartbeat:
    """A rank's side. Without RUNNER_HEARTBEAT (a trainer built in a test) it does nothing."""

    def __init__(self, path: str | None, local_rank: int, rank: int, attempt: int):
        self._map: mmap.mmap | None = None
        self._offset = _slot_offset(local_rank)
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
            get_attempt(),
        )

    def beat(self, phase: Phase, step: int | None = None) -> None:
        if step is not None:
            self.step = step
        self.beats += 1
        if self._map is not None:
            head, step, beats = self._head, self.step, self.beats
            _SLOT.pack_into(self._map, self._offset, *head, phase, step, beats, time.time())

    @contextlib.contextmanager
    def during(self, phase: Phase) -> Iterator[None]:
        """Beat `phase` for what runs inside (a checkpoint, a rollback), then STEP again:
        the watchdog gives each phase its own time limit."""
        self.beat(phase)
        try:
            yield
        finally:
            self.beat(Phase.STEP)

    def stop_after(self, step: int) -> bool:
        """At the end of `step`: whether a graceful stop was asked and every rank stops here.

        Free until a stop is asked (one read of the map). Then a rank that does not know the
        agreed step yet pauses until its agent writes it; the agents pick a step no rank has
        passed (reachable_step, over every node), so all ranks stop after the same one.
        """
        if self._map is None:
            return False
        asked, stop = _CONTROL.unpack_from(self._map, 0)
        if not asked:
            return False
        if not stop:
            self.beat(Phase.PAUSED, step)
            while not stop:
                time.sleep(PAUSE_POLL_S)
                stop = _CONTROL.unpack_from(self._map, 0)[1]
            self.beat(Phase.STEP)
        return step >= stop
