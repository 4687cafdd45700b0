"""When a rank writes its checkpoints: at once, or with `checkpoint.async` in the background
while training goes on.

An asynchronous checkpoint copies the state off the device at its step (the only time
training waits), and the engine writes the copy in the background (ddp: rank 0's writer
thread; fsdp: torch.distributed.checkpoint's async_save, whose collectives run on a gloo
group of their own). It becomes a checkpoint, and the latest, only when rank 0 seals it:
rank 0 looks at each step whether its write is done, which for DCP means every rank's is
(the coordinator writes the metadata last). Sealing needs no collective, so nothing here
can meet the training's collectives out of order. Before the next checkpoint, a graceful
stop and the end of training, every rank waits for its write. A rank that dies before the
seal, or a write that fails, leaves the previous checkpoint as the resume point.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from runner import dist as rdist
from runner.engines.base import Engine
from runner.errors import describe
from runner.heartbeat import Heartbeat, Phase
from runner.rundir.checkpoints import CheckpointStore, checkpoint_name
from runner.spec import RunSpec
from runner.train import chaos, checkpointing

log = logging.getLogger(__name__)


class CheckpointWriter:
    def __init__(
        self,
        store: CheckpointStore,
        engine: Engine,
        spec: RunSpec,
        heart: Heartbeat,
        saved: Callable[[Path, int], None] | None = None,
        config: dict[str, Any] | None = None,
    ):
        """`saved(path, step)`: called once a checkpoint is complete on this rank (rank 0:
        sealed). `config`: the run's config as config.yaml holds it, kept in each one."""
        self.store, self.engine, self.spec, self.heart = store, engine, spec, heart
        self.config = config
        self.saved = saved or (lambda path, step: None)
        self.background = spec.checkpoint.async_
        self.rank = rdist.get_global_rank()
        self.blocked_s: list[float] = []  # how long training waited, per checkpoint
        self._client: dict[str, Any] | None = None  # the checkpoint in flight, if any
        self._future: Future | None = None

    def save(self, step: int, samples: int, extra: dict[str, Any]) -> None:
        """Every rank: a checkpoint of `step`, written now or started in the background."""
        started = time.perf_counter()
        if self._future is not None:  # the one before, first (the caller beat Phase.SAVE)
            self._complete()
        if not self.background:
            checkpointing.save(
                self.store, self.engine, self.spec, step, samples, extra, self.config
            )
            self.saved(self.store.root / checkpoint_name(step), step)
        else:
            client = checkpointing.start(self.store, step, samples, extra, self.config)
            partial = self.store.partial_dir(step)
            with checkpointing.failing_write(self.store, step):
                chaos.maybe_fill_disk(self.spec.chaos, self.rank, step, partial)
                self._future = self.engine.save_checkpoint_async(partial, client)
            self._client = client
            chaos.maybe_kill_in_checkpoint(self.spec.chaos, self.rank, step)
        self.blocked_s.append(time.perf_counter() - started)

    def poll(self) -> None:
        """Each step, no collective: once this rank's write is done, see that it worked and
        (rank 0) seal the checkpoint."""
        if self._future is not None and self._future.done():
            self._complete()

    def finish(self) -> None:
        """Wait for the checkpoint in flight (every rank its own write) and seal it; the
        watchdog's checkpoint time limit holds meanwhile."""
        if self._future is not None:
            self.heart.beat(Phase.SAVE)
            self._complete()
            self.heart.beat(Phase.STEP)

    def _complete(self) -> None:
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
        if self.rank == 0:
            checkpointing.seal(self.store, self.engine, self.spec, self._client)
            log.info("checkpoint of step %d written in the background", step)
        self._future = self._client = None
        self.saved(self.store.root / checkpoint_name(step), step)
