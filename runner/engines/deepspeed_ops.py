"""DeepSpeed's CPU shared-memory comm op: built once per install, announced when it builds.

DeepSpeed JIT-compiles this op the first time a CPU run initialises its comm backend (about
45 s on 2 cores) and caches it in the environment's own torch_extensions folder, built by the
environment's own ninja (runner.processes.keep_extensions_in_environment). `make install`
builds it (`python -m runner.engines.deepspeed_ops`), so that no run pays for it by surprise.
Where a run does build it (another torch, a DeepSpeed upgrade, a folder removed), the
terminal says so, and how long the last build took (`load_shared_memory_op`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runner.processes import EXTENSIONS_ENV, keep_extensions_in_environment, without_mlflow

BUILDER = "ShareMemCommBuilder"
QUIET_S = 3.0  # a load that takes longer is a build: say so
TIMES_FILE = "runner_build_seconds.json"  # in the extensions folder: each op's last build


def import_deepspeed(name: str, device: str) -> Any:
    """DeepSpeed, imported for parallelism `name` on `device`: the accelerator it picks as
    it loads is the run's (on a CPU run it must not guess CUDA), its ops build into this
    environment, and MLflow stays out of it (`without_mlflow`)."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device.startswith("cuda") else "cpu")
    keep_extensions_in_environment()  # a rank started by something other than runner
    try:
        with without_mlflow():
            import deepspeed
    except ImportError as exc:
        raise RuntimeError(
            f"parallelism={name} needs DeepSpeed, which cannot be imported: {exc}"
        ) from exc
    return deepspeed


def _builder() -> Any | None:
    """DeepSpeed's builder of the op on the CPU, or None where none is needed (ImportError:
    no DeepSpeed)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    keep_extensions_in_environment()
    with without_mlflow():
        from deepspeed.accelerator import get_accelerator

    return get_accelerator().create_op_builder(BUILDER)


def _times_file() -> Path:
    root = os.environ.get(EXTENSIONS_ENV) or Path.home() / ".cache" / "torch_extensions"
    return Path(root) / TIMES_FILE


def last_build_seconds(name: str) -> float | None:
    try:
        return float(json.loads(_times_file().read_text())[name])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _record_build(name: str, seconds: float) -> None:
    path = _times_file()
    try:
        times = json.loads(path.read_text())
    except (OSError, ValueError):
        times = {}
    times[name] = round(seconds, 1)
    with contextlib.suppress(OSError):  # only an estimate for the next build's message
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(times) + "\n")
        os.replace(tmp, path)


def building_message(name: str, cores: int | None = None) -> str:
    """What the terminal says while the op builds: what, where, and for about how long."""
    last = last_build_seconds(name)
    if last is not None:
        estimate = f"the last build here took {last:.0f} s"
    else:
        cores = cores or os.cpu_count() or 1
        estimate = "usually 1-2 minutes" if cores <= 4 else "usually under a minute"
        estimate += f" on {cores} cores"
    where = os.environ.get(EXTENSIONS_ENV) or "~/.cache/torch_extensions"
    return (
        f"building DeepSpeed's CPU communication op ({name}) into {where}: once per install, "
        f"{estimate} (make install builds it ahead)"
    )


def load_shared_memory_op(say: Callable[[str], None] | None = None) -> None:
    """Load the op, building it if it must; a load that runs longer than QUIET_S is a build:
    `say` tells the user what is happening, then how long it took."""
    try:
        builder = _builder()
    except ImportError:
        return  # no DeepSpeed: the engine reports it
    if builder is None:
        return
    name = builder.NAME
    announced = threading.Event()

    def announce() -> None:
        announced.set()
        if say is not None:
            say(building_message(name))

    timer = threading.Timer(QUIET_S, announce)
    timer.daemon = True
    started = time.monotonic()
    timer.start()
    try:
        builder.load(verbose=False)
    finally:
        timer.cancel()
    took = time.monotonic() - started
    if announced.is_set():
        _record_build(name, took)
        if say is not None:
            say(f"DeepSpeed's {name} op built in {took:.0f} s; later runs load it at once")


def main() -> None:
    """`python -m runner.engines.deepspeed_ops` (make install): build the op now."""

    def say(line: str) -> None:
        print(f"deepspeed_ops: {line}", file=sys.stderr, flush=True)

    try:
        if _builder() is None:
            say("this DeepSpeed accelerator needs no shared-memory op")
            return
    except ImportError:
        say("DeepSpeed is not installed; nothing to build")
        return
    started = time.monotonic()
    load_shared_memory_op(say)
    say(f"ready ({time.monotonic() - started:.0f}s)")


if __name__ == "__main__":
    main()
