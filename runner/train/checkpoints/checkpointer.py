"""The checkpointer: when a rank's checkpoints are written, how, and where a rollback goes.

It decides (every `checkpoint.interval` steps, and the last), checks that nothing
non-finite is saved, adds each rank's position in a stream to what the trainer gives it,
and writes through one path: the client state is gathered, the engine's state is copied
and written (runner.train.checkpoints.checkpointing has the layout), and the checkpoint becomes one,
and the latest, when rank 0 seals it. Without `checkpoint.async` that happens at once: every
rank's files are written, rank 0 seals, and training goes on. With it, the engine writes the
copy in the background (ddp: rank 0's writer thread; fsdp: torch.distributed.checkpoint's
async_save, whose collectives run on a gloo group of their own) and rank 0 seals it at a
later step, once its write is done (for DCP that means every rank's: the coordinator writes
the metadata last); sealing needs no collective, so nothing here meets the training's
collectives out of order. Before the next checkpoint, a graceful stop, a rollback and the
end, every rank waits for the one in flight. A rank that dies before the seal, or a write
that fails, leaves the previous checkpoint as the resume point.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from runner import dist as rdist
from runner.engines.base import Engine
from runner.errors import describe
from runner.heartbeat import Heartbeat, Phase
from runner.rundir.checkpoints import CheckpointStore, checkpoint_name
from runner.rundir.files import RunDir
from runner.spec import RunSpec
from runner.train.checkpoints import checkpointing
from runner.train.guards import chaos
from runner.train.guards.nonfinite import NonFiniteGuard
from runner.train.records.notices import Say

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resumed:
    """Where an attempt starts: after `step` and `samples`; `from_step`: the checkpoint's
    step (None: a fresh start); `state`: its client state, read back by the kept parts."""

    step: int
    samples: int
    from_step: int | None
    state: dict[str, Any]

    @classmethod
    def of(cls, client: dict[str, Any]) -> Resumed:
        """From a checkpoint's client state ({}: a fresh start)."""
        return cls(client.get("step", 0), client.get("samples", 0), client.get("step"), client)


class Kept(Protocol):
    def checkpoint_state(self) -> dict[str, Any]: ...


class Checkpointer:
    def __init__(
        self,
        spec: RunSpec,
        run_dir: RunDir,
        engine: Engine,
        heart: Heartbeat,
        guard: NonFiniteGuard,
        stream: Any,
        config: dict[str, Any] | None = None,
        saved: Callable[[Path, int], None] | None = None,
        say: Say | None = None,
    ):
        """`stream`: the training loader of an iterable dataset (its position is kept), else
        None; `config`: the run's config as config.yaml holds it, kept in each checkpoint;
        `saved(path, step)`: called once a checkpoint is complete on this rank (rank 0:
        sealed); `say`: lines for the user (a damaged checkpoint skipped)."""
        self.spec, self.engine, self.heart, self.guard = spec, engine, heart, guard
        self.stream, self.config = stream, config
        self.saved = saved or (lambda path, step: None)
        self.say = say or log.warning
        self.store = CheckpointStore(run_dir.checkpoints, spec.checkpoint.keep)
        self.background = spec.checkpoint.async_
        self.rank = rdist.get_global_rank()
        self.digests = spec.checkpoint.digest  # each file's, in the manifest rank 0 writes
        self.blocked_s: list[float] = []  # how long training waited, per checkpoint
        self.written_s: list[float] = []  # rank 0: from its start until sealed, per checkpoint
        self._client: dict[str, Any] | None = None  # the checkpoint in flight, if any
        self._future: Future | None = None
        self._started = 0.0  # when the checkpoint in flight began (perf_counter) ...
        self._done_at: float | None = None  # ... and when its background write ended
        self.parts: tuple[Kept, ...] = ()

    def resume(self) -> Resumed:
        """Every rank: this attempt's start (checkpointing.resume); step 0 for a fresh one."""
        client = checkpointing.resume(
            self.store, self.spec.resume, self.engine, self.stream, self.say
        )
        return Resumed.of(client)

    def keeps(self, *parts: Kept) -> None:
        """Parts whose `checkpoint_state()` each checkpoint holds (the grad_accum that
        auto settled on, the batches a rollback skips); each reads its own back from the
        client state `resume` returns."""
        self.parts = parts

    def latest(self) -> Path | None:
        return self.store.latest()

    def summary(self, key: str | None, details: dict[str, Any], kept: bool) -> dict[str, Any]:
        """summary.json's checkpoint figures, and an ending's own entry (`key`: its
        `details`, with the latest checkpoint where it `kept` one)."""
        facts: dict[str, Any] = {
            "checkpoint_blocked_s": [round(s, 4) for s in self.blocked_s],
            "checkpoint_written_s": [round(s, 4) for s in self.written_s] or None,
        }
        if key is not None:
            latest = self.latest() if kept else None
            run_root = self.store.root.parent
            place = {"checkpoint": str(latest.relative_to(run_root))} if latest else {}
            facts[key] = details | place
        return facts

    def due(self, step: int, last: bool) -> bool:
        interval = self.spec.checkpoint.interval
        return last or bool(interval and step % interval == 0)

    def save(self, step: int, samples: int) -> float:
        """Every rank: a checkpoint of `step`, after `samples`, holding the kept parts'
        state; written now, or started in the background. Returns the seconds training
        waited."""
        started = time.perf_counter()
        with self.heart.during(Phase.SAVE):
            self.guard.check_before_saving(self.engine.module, step)
            extra = {k: v for part in self.parts for k, v in part.checkpoint_state().items()}
            if self.stream is not None:  # every rank's position in its part of the stream
                extra = {**extra, "data": rdist.all_gather_object(self.stream.state_dict())}
            if self._future is not None:  # the one before, first
                self._complete(together=False)
            self._started = time.perf_counter()
            client = checkpointing.start(self.store, step, samples, extra, self.config)
            partial = self.store.partial_dir(step)
            with checkpointing.failing_write(self.store, step):
                chaos.maybe_fill_disk(self.spec.chaos, self.rank, step, partial)
                self._future = self._write(partial, client)
            self._client = client
            chaos.maybe_kill_in_checkpoint(self.spec.chaos, self.rank, step)
            if not self.background:
                self._complete(together=True)
        blocked = time.perf_counter() - started
        self.blocked_s.append(blocked)
        return blocked

    def poll(self) -> None:
        """Each step, no collective: once this rank's background write is done, see that it
        worked and (rank 0) seal the checkpoint."""
        if self._future is not None and self._future.done():
            self._complete(together=False)

    def finish(self) -> None:
        """Wait for the checkpoint in flight (every rank its own write) and seal it; the
        watchdog's checkpoint time limit holds meanwhile."""
        if self._future is not None:
            with self.heart.during(Phase.SAVE):
                self._complete(together=False)

    def restore_before(self, step: int) -> tuple[Path, Resumed] | None:
        """Every rank: the state of the newest checkpoint written before `step` (a loss
        spike's rollback): the checkpoint and where training goes on, or None without one."""
        self.finish()  # an asynchronous checkpoint still being written counts
        target = checkpointing.newest_before(self.store, step)
        if target is None:
            return None
        with self.heart.during(Phase.SAVE):
            client = checkpointing.restore(target, self.engine, self.store, self.stream)
        return target, Resumed.of(client)

    def _write(self, partial: Path, client: dict[str, Any]) -> Future:
        """The engine's state into `partial` (its large files digested as they are written:
        runner.rundir.checkpoints.DigestingWriter): in the background, or at once (a future
        that is already done)."""
        if self.background:
            writing = self.engine.save_checkpoint_async(partial, client)
            writing.add_done_callback(self._written)
            return writing
        self.engine.save_checkpoint(partial, client)
        written: Future = Future()
        written.set_result(None)
        return written

    def _written(self, _future: Future | None = None) -> None:
        self._done_at = time.perf_counter()

    def _complete(self, together: bool) -> None:
        """The write's outcome, then rank 0's seal. `together`: every rank is here (a
        checkpoint written at once), so rank 0 seals once every rank's files are written."""
        assert self._future is not None and self._client is not None
        step = self._client["step"]
        with checkpointing.failing_write(self.store, step):
            try:
                self._future.result()  # the write's error, if it failed
            except Exception:
                raise
            except BaseException as exc:  # DCP's CheckpointException is a BaseException
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                raise RuntimeError(describe(exc)) from exc
        if together:
            rdist.barrier()
        if self.rank == 0:
            # the digests noted as the files were written, the rest (small ones, DeepSpeed's
            # files) read back as the manifest is written
            digests: dict[str, str] | None = {} if self.digests else None
            checkpointing.seal(self.store, self.engine, self.spec, self._client, digests)
            done = self._done_at if self.background and self._done_at else time.perf_counter()
            self.written_s.append(done - self._started)
            self._done_at = None
            if not together:
                log.info("checkpoint of step %d written in the background", step)
        if together:
            rdist.barrier()
        self._future = self._client = None
        self.saved(self.store.root / checkpoint_name(step), step)
