"""The run directory: where each artifact lives, and how it is written.

Every finished artifact is written to a temporary name and renamed into place,
so a reader never sees half a file under the real name. metrics.jsonl is the
one append-only file; a reader skips a torn last line.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

TRACKER_RUNS = "tracker_runs.json"  # in a run directory, and at a sweep's root
EVAL_FILE = "eval.json"  # what `runner eval` measured, in its run directory
SUMMARY_FILE = "summary.json"  # how a run ended: runner.rundir.summary reads and writes it
HYDRA_DIR = ".hydra"  # Hydra's record of the run, written once runner accepts it


@dataclass(frozen=True)
class RunDir:
    """Paths of one run's artifacts (see docs/concepts.md, "Run directory")."""

    root: Path

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def env(self) -> Path:
        return self.root / "env.json"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.log"

    def error_file(self, rank: int, attempt: int) -> Path:
        return self.logs / "errors" / f"attempt{attempt}_rank{rank}.json"

    def starts(self, rank: int) -> Path:
        """How many times this rank started (launcher=ray: Ray restarts its workers)."""
        return self.logs / f".starts-rank{rank}"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY_FILE

    @property
    def model(self) -> Path:
        return self.root / "model.pt"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def seed_weights(self) -> Path:
        """The initial weights a meta_init run's ranks fill their shards from."""
        return self.root / "init" / "weights.safetensors"

    @property
    def tracker_runs(self) -> Path:
        return self.root / TRACKER_RUNS

    @property
    def start_found(self) -> Path:
        """What a sweep's job found in its directory as it started on SLURM, under the job's
        key: every node of a multi-node job goes on from what the first node found there."""
        return self.root / ".start.json"


def write_atomic(path: Path, data: bytes | str) -> None:
    """Write `data` to `path` so that `path` is either the old file or the whole new one."""
    with replacing(path) as tmp, open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` to write the new file into; once the block ends, the
    file is fsynced and renamed to `path`, so `path` is either the old file or the whole
    new one. A failed block (a full disk, EIO) leaves no temporary behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


@contextlib.contextmanager
def file_lock(path: Path, on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
    """Hold an exclusive lock on `path` across processes (the `filelock` library: flock, the
    file removed on release). While held, the file names its holder (pid and host); a process
    that must wait first passes that name to `on_wait`."""
    from filelock import FileLock, Timeout

    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        if on_wait is not None:
            on_wait(_holder(path))
        lock.acquire()
    try:
        path.write_text(f"pid {os.getpid()} on {socket.gethostname()}\n")
        yield
    finally:
        lock.release()


def _holder(path: Path, patience: float = 1.0) -> str:
    """Who holds the lock at `path`, as the holder wrote it. One that took the lock a moment
    ago may not have written yet: read again for up to `patience` seconds."""
    import time

    deadline = time.monotonic() + patience
    while True:
        try:
            text = path.read_text().strip()
        except OSError:  # released (and removed) in between
            return "another process"
        if text or time.monotonic() > deadline:
            return text or "another process"
        time.sleep(0.02)


def write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json(path: Path) -> Any | None:
    """The JSON in `path`, or None if it is missing or not (yet) valid."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_jsonl(path: Path, damaged: list[int] | None = None) -> list[dict[str, Any]]:
    """All complete records of a JSON-lines file (a torn last line is skipped). `damaged`
    collects the numbers of the other lines that could not be read (bytes changed in it)."""
    records = []
    try:
        text = path.read_bytes().decode(errors="replace")
    except OSError:
        return []
    lines = text.splitlines()
    torn = not text.endswith("\n")  # a write cut short: its last line has no end
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                raise ValueError(line)
            records.append(record)
        except ValueError:
            if damaged is not None and (number < len(lines) or not torn):
                damaged.append(number)
    return records


def tail(path: Path, lines: int = 20) -> str:
    """The last `lines` lines of a text file ('' if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git_commit(cwd: Path) -> dict[str, Any] | None:
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5
        )
        if commit.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=5,
        )
        return {"commit": commit.stdout.strip(), "dirty": bool(dirty.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return None


def devices_given() -> dict[str, Any]:
    """The devices this run was given: CUDA_VISIBLE_DEVICES (null: not set) and the cores it
    may run on (a sweep's slot under hydra/launcher=runner, taskset, a cgroup)."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = list(range(os.cpu_count() or 1))
    return {"CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"), "cores": cores}


def environment_info(code_dirs: Sequence[str] = ()) -> dict[str, Any]:
    """Versions, code revisions (runner's, the launch directory's and each `code_dir`'s:
    commit and whether the tree is dirty) and host: enough to tell two runs' environments
    apart. Package versions come from metadata, so nothing heavy is imported.
    """
    package_root = Path(__file__).resolve().parent.parent
    return {
        "python": sys.version.split()[0],
        "packages": {
            name: _version(name)
            for name in (
                "torch",
                "torchvision",
                "deepspeed",
                "hydra-core",
                "omegaconf",
                "numpy",
                "runner",
            )
        },
        "git": {
            "runner": _git_commit(package_root),
            "cwd": _git_commit(Path.cwd()),
            "code_dir": {d: _git_commit(Path(d)) for d in code_dirs},
        },
        "hosts": [socket.gethostname()],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "devices": devices_given(),
        "argv": sys.argv,
        "cwd": str(Path.cwd()),
    }


def holds_a_run(run_dir: Path) -> bool:
    """Whether a directory holds a run (or the start of one) of its own."""
    return any(
        (run_dir / name).exists()
        for name in (SUMMARY_FILE, "config.yaml", "checkpoints", HYDRA_DIR)
    )
