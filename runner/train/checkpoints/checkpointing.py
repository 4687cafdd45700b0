"""Saving and resuming a run from the ranks' side (on disk: runner.rundir.checkpoints).

A checkpoint holds what a resumed run needs to continue exactly where it left
off: the engine's state (model, optimizer, schedule, loss scaler; DeepSpeed's
own files for ZeRO), the step and sample counters (the sampler's position
follows from the step), every rank's RNG states and the spec it was made with.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from runner import dist as rdist
from runner.engines.base import Engine
from runner.errors import Explained, describe
from runner.models.shapes import state_shapes
from runner.rundir.checkpoints import CheckpointStore, Pick, newest_intact, pick_from, step_of
from runner.rundir.files import write_atomic
from runner.spec import RunSpec, slurm
from runner.spec.resume_check import META_FILE, checkpoint_meta, read_meta
from runner.train.records.notices import Say

log = logging.getLogger(__name__)


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the previous one stays the resume point."""


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """The generators' states as a checkpoint kept them. Both torch setters take a CPU byte
    tensor: a checkpoint loaded onto the GPU (map_location) holds them there."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


def start(
    store: CheckpointStore,
    step: int,
    samples: int,
    extra: dict[str, Any] | None,
    config: dict[str, Any] | None,
) -> dict[str, Any]:
    """Every rank: the client state of a checkpoint of `step`, once rank 0 made its empty
    partial directory (before the gather of every rank's RNG streams, a collective no rank
    leaves before rank 0 joined it: no barrier of its own). `config`: the run's config as
    written (placeholders and masked secrets, never their values), kept with the state."""
    if rdist.get_global_rank() == 0:
        store.begin(step)
    return {
        "step": step,
        "samples": samples,
        "world_size": rdist.get_world_size(),
        "spec": config,
        "rng": rdist.all_gather_object(rng_state()),
        **(extra or {}),
    }


def seal(
    store: CheckpointStore,
    engine: Engine,
    spec: RunSpec,
    client: dict[str, Any],
    digests: dict[str, str] | None,
) -> None:
    """Rank 0, once every rank's files are written (their digests noted as they were): the
    checkpoint's meta.json, then the manifest and the rename that make it a finished
    checkpoint and the latest one."""
    step = client["step"]
    shapes = state_shapes(engine.module)
    meta = checkpoint_meta(
        spec, step, client["samples"], client["world_size"], shapes, "data" in client
    )
    with failing_write(store, step):
        write_atomic(store.partial_dir(step) / META_FILE, json.dumps(meta, indent=1))
        store.commit(step, digests)


class CheckpointDamaged(Explained):
    """No checkpoint to resume from holds the bytes it was sealed with."""


class CheckpointReadError(Explained):
    """A checkpoint could not be read back into the engine (one sealed without digests, or
    one damaged after it was verified)."""


@contextlib.contextmanager
def failing_write(store: CheckpointStore, step: int) -> Iterator[None]:
    """A write that fails (a full disk, EIO, a quota) ends with a message naming the path and
    the OS error; the half-written checkpoint never becomes latest. Its partial directory
    stays while the other ranks may still write into it (pulled from under them, their
    writes would fail too, and one of those could be reported as the run's cause): the
    parent removes it once every rank is gone (runner.launch.outcomes), a restart's rank 0
    as it starts (find_resume_point)."""
    try:
        yield
    except (OSError, RuntimeError) as exc:  # torch.save reports ENOSPC as a RuntimeError
        partial = store.partial_dir(step)
        if isinstance(exc, OSError) and exc.strerror:
            cause = f"{exc.strerror} ({exc.filename or partial})"
        else:
            cause = f"{describe(exc)} ({partial})"
        with contextlib.suppress(OSError):
            cause += f", {shutil.disk_usage(store.root).free / 2**30:.1f} GiB free there"
        raise CheckpointWriteError(
            f"checkpoint of step {step} could not be written: {cause}; the resume point "
            f"stays {store.latest() or 'none'}"
        ) from exc


def find_resume_point(store: CheckpointStore, resume: str | None, say: Say) -> Path | None:
    """The checkpoint this attempt starts from, or None for a fresh start.

    A restarted attempt (the elastic agent's restart after a failure, a SLURM job started
    again) continues from the run's newest intact checkpoint; otherwise, and before the run
    has one, `resume` decides: auto = this run directory's, PATH = a checkpoint or a run
    directory. Rank 0 reads the checkpoint back against its digests, skips a damaged one
    for the one before (`say` names it: on the terminal where the parent did not already),
    and tells the others; it also sweeps away what an earlier attempt left half written.
    """
    choice = None
    if rdist.get_global_rank() == 0:
        store.discard_unfinished()  # what an earlier attempt left half written
        restarted = rdist.get_attempt() > 0
        pick = Pick(None)
        if restarted or resume == "auto" or slurm.requeued(os.environ):
            pick = newest_intact(store.root)
        if pick.path is None and not pick.skipped and resume not in (None, "auto"):
            pick = pick_from(Path(resume))
        for line in pick.skipped_lines():  # the parent said so before this launch's first start
            (say if restarted else log.warning)(line)
        if pick.path is None and pick.skipped:
            damaged = "; ".join(f"{p} ({why})" for p, why in pick.skipped)
            raise CheckpointDamaged(f"no intact checkpoint to resume from: {damaged}")
        choice = pick.path
    choice = rdist.broadcast_object(str(choice) if choice else None)
    return Path(choice) if choice else None


def load(path: Path, engine: Engine, store: CheckpointStore) -> dict[str, Any]:
    """Restore the engine from `path` and this rank's RNG streams; return the client state.

    A checkpoint from another world size is resharded by the engine in a scratch directory
    of this run's store, removed once every rank has loaded. The RNG streams are per rank,
    so they carry over only at the same world size (augmentation draws differ; the samples
    and their order do not).
    """
    meta = read_meta(path)
    saved_world = meta.get("world_size") if meta else None
    reshard = None
    if saved_world is not None and saved_world != rdist.get_world_size():
        reshard = store.scratch_dir(step_of(path))
        if rdist.get_global_rank() == 0:
            shutil.rmtree(reshard, ignore_errors=True)
            reshard.mkdir(parents=True)
        rdist.barrier()
    try:
        client = engine.load_checkpoint(path, reshard)
    except Exception as exc:  # an unpickling error names no file: this says which checkpoint
        raise CheckpointReadError(f"checkpoint {path} could not be read: {describe(exc)}") from exc
    finally:
        if reshard is not None:
            rdist.barrier()
            if rdist.get_global_rank() == 0:
                shutil.rmtree(reshard, ignore_errors=True)
    if client["world_size"] == rdist.get_world_size():
        set_rng_state(client["rng"][rdist.get_global_rank()])
    return client


def resume(
    store: CheckpointStore, resume: str | None, engine: Engine, stream: Any, say: Say
) -> dict:
    """Start this attempt where it should (find_resume_point): the engine, the RNG streams
    and, for an iterable training set (`stream`, else None), this rank's position in its
    part. The checkpoint's client state ({} for a fresh start)."""
    start = find_resume_point(store, resume, say)
    if start is None:
        return {}
    client = restore(start, engine, store, stream)
    log.info("resumed from %s (step %d)", start, client["step"])
    return client


def restore(path: Path, engine: Engine, store: CheckpointStore, stream: Any) -> dict:
    """Every rank: the engine, the RNG streams and a stream's position from `path`."""
    client = load(path, engine, store)
    if stream is not None and "data" in client:
        stream.load_state_dict(client["data"][rdist.get_global_rank()])
    elif stream is not None:  # written with other data: a position means nothing here
        log.info("the checkpoint holds no stream position: the stream starts over")
    return client


def newest_before(store: CheckpointStore, step: int) -> Path | None:
    """The newest finished checkpoint of a step before `step` (rank 0 looks, every rank
    gets its answer)."""
    found = None
    if rdist.get_global_rank() == 0:
        earlier = [p for p in store.finished() if step_of(p) < step]
        found = str(earlier[-1]) if earlier else None
    found = rdist.broadcast_object(found)
    return Path(found) if found else None
