"""Process plumbing shared by the parent, the agent and the ranks (stdlib only).

A chain parent -> agent -> ranks must never leave orphans: each child asks the
kernel to signal it when its parent dies (Linux PR_SET_PDEATHSIG), so killing
any link, even with SIGKILL, takes everything below it down.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import sys
import sysconfig
import time
from collections.abc import Iterator, Sequence

_PR_SET_PDEATHSIG = 1
# Environment the processes hand down (each name defined once, for parent, agent and ranks):
START_METHOD_ENV = "RUNNER_START_METHOD"  # start_method as the command line set it (agent)
RANK_PARENT_ENV = "RUNNER_RANK_PARENT_PID"  # the process a rank dies with (PR_SET_PDEATHSIG)
FORKED_ENV = "RUNNER_FORKED"  # set in a forked rank (its log's first line says so)
# set for a sweep's jobs that share a terminal side by side: their bars would share its line,
# so rank 0 draws none (plain lines where it would print them); the job's config is untouched
NO_BAR_ENV = "RUNNER_NO_PROGRESS_BAR"
EXTENSIONS_ENV = "TORCH_EXTENSIONS_DIR"  # where torch builds C++ extensions (DeepSpeed's ops)
WARM_SERVER_ENV = "RUNNER_WARM_SERVER"  # a warm server's socket (runner.launch.warm_server)
# Signals exec resets to their defaults unless they are ignored: what a fork that becomes a
# new command (a rank, a warm agent) resets, keeping the ones its starter ignores
EXEC_RESET_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGCHLD)


def ignored_signals() -> list[str]:
    """The names of EXEC_RESET_SIGNALS this process ignores (a job started in the background
    ignores SIGINT), which a command it starts keeps ignoring."""
    return [s.name for s in EXEC_RESET_SIGNALS if signal.getsignal(s) == signal.SIG_IGN]


def keep_extensions_in_environment() -> None:
    """Build torch's C++ extensions (DeepSpeed's CPU communication op) into this Python
    environment's own cache, `<venv>/torch_extensions`, for this process and every process
    it starts. torch's default, ~/.cache/torch_extensions, is shared by every checkout on
    the machine: each rebuilt the op whenever another had built it from its own source path
    (minutes on 2 cores), and two building at once raced. A TORCH_EXTENSIONS_DIR already set
    wins; outside a virtual environment torch's default stays."""
    if sys.prefix != sys.base_prefix:
        os.environ.setdefault(EXTENSIONS_ENV, os.path.join(sys.prefix, "torch_extensions"))
    use_environments_ninja()


def environments_ninja() -> str | None:
    """The ninja this Python environment installed (DeepSpeed requires the `ninja` package,
    which puts one beside the environment's scripts), or None."""
    scripts = sysconfig.get_path("scripts")
    found = shutil.which("ninja", path=scripts) if scripts else None
    return os.path.realpath(found) if found else None


def use_environments_ninja() -> None:
    """Have torch's extension builds (it runs `ninja` from PATH) use the environment's own
    ninja, here and in every process started from here. Two ninjas read each other's build
    log as changed (1.11 and 1.13: `command line changed for shm.o`), so a user switching
    between an activated venv (its ninja first) and `.venv/bin/runner` (the system's first)
    rebuilt DeepSpeed's op, for minutes, at every switch."""
    ninja = environments_ninja()
    if ninja is None:
        return
    first = shutil.which("ninja")
    if first is not None and os.path.realpath(first) == ninja:
        return
    os.environ["PATH"] = os.pathsep.join([os.path.dirname(ninja), os.environ.get("PATH", "")])


def die_with_parent(sig: signal.Signals, expected_parent: int | None = None) -> None:
    """Have the kernel send `sig` to this process when its parent exits (Linux only).

    `expected_parent` closes the race where the parent died before the call.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = expected_parent if expected_parent is not None else os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)


def can_fork_ranks() -> bool:
    """Whether ranks may be forked from a process that imported torch: on Linux. macOS'
    system frameworks do not survive a fork (Python spawns there too); Windows cannot."""
    return sys.platform.startswith("linux")


@contextlib.contextmanager
def stops_held() -> Iterator[None]:
    """SIGTERM and SIGHUP held back until the block ends, then delivered to the handlers
    they had: for the few file moves that must not stop halfway (a scheduler's SIGTERM right
    after the agent ended). Noted by a handler of its own rather than masked: a mask holds
    only this thread, and another thread would take the signal for Python's handler."""
    got: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda signum, _frame: got.append(signum))
        for sig in (signal.SIGTERM, signal.SIGHUP)
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in dict.fromkeys(got):
            signal.raise_signal(signum)


def exit_code_for_signal(sig: int) -> int:
    """The shell convention for 'ended by signal sig'."""
    return 128 + int(sig)


def add_code_dirs(directories: Sequence[str]) -> None:
    """Make the user's code importable here and in every process started from here
    (sys.path now, PYTHONPATH for children); the first directory wins a name clash."""
    directories = [d for d in directories if d]
    for directory in reversed(directories):
        if directory not in sys.path:
            sys.path.insert(0, directory)
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    merged = list(dict.fromkeys([*directories, *inherited]))
    if merged:
        os.environ["PYTHONPATH"] = os.pathsep.join(merged)


# A local Ray cluster's workers (a run's ranks, a sweep's trials) run at the priority elastic
# ranks have: Ray starts workers at nice 15, so that any other process takes their CPU first.
LOCAL_RAY_CLUSTER = {"worker_niceness": 0}


def descendants(root: int) -> set[int]:
    """Every process below `root`: a local cluster's GCS, raylet, workers."""
    import psutil

    try:
        return {child.pid for child in psutil.Process(root).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def reap(pids: set[int], timeout_s: float = 15.0) -> None:
    """Wait for `pids` to end (ray.shutdown asked them to), then kill what is left. A zombie
    counts as ended: its parent, not us, collects it."""
    deadline = time.monotonic() + timeout_s
    while pids and time.monotonic() < deadline:
        pids = {pid for pid in pids if running(pid)}
        time.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@contextlib.contextmanager
def without_mlflow() -> Iterator[None]:
    """`import mlflow` fails inside, unless something imported it already: around any first
    import of DeepSpeed. Its autotuner (which runner never runs) imports MLflow as DeepSpeed
    loads, where MLflow is installed: 1.3 s of every DeepSpeed rank's start here, and a
    thread (pyarrow's jemalloc). A rank that logs to MLflow imports it later as usual."""
    if "mlflow" in sys.modules:
        yield
        return
    sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import` raises ImportError
    try:
        yield
    finally:
        if sys.modules.get("mlflow", False) is None:
            del sys.modules["mlflow"]


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    """OPENBLAS_NUM_THREADS=1 inside, as it was after: an OpenBLAS loaded inside (numpy's,
    scipy's) sizes its thread pool from the environment as it loads, and a process that
    forks the ranks next must not hold a pool's threads."""
    before = os.environ.get("OPENBLAS_NUM_THREADS")
    os.environ["OPENBLAS_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["OPENBLAS_NUM_THREADS"]
        else:
            os.environ["OPENBLAS_NUM_THREADS"] = before


class _KnownNoise(logging.Filter):
    """Library messages about the libraries themselves, which a user can do nothing about."""

    def filter(self, record: logging.LogRecord) -> bool:
        # torchao (imported by transformers) registers enums with torch's pytree, which torch
        # 2.15 warns is deprecated: two lines on every run of a Hugging Face model
        return "is an Enum subclass and is now natively supported" not in str(record.msg)


def quiet_library_noise() -> None:
    """Leave out of every process's output what only the libraries' authors can act on."""
    logging.getLogger("torch.utils._pytree").addFilter(_KnownNoise())


def process_place() -> dict[str, str]:
    """Where this process lives: its cgroup and namespaces. A SLURM job step's, a container's
    or another network namespace's command must not have its agent forked outside them."""
    found = {}
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as cgroup:
        found["cgroup"] = cgroup.read()
    for ns in ("mnt", "net", "pid", "user"):
        with contextlib.suppress(OSError):
            found[ns] = os.readlink(f"/proc/self/ns/{ns}")
    return found
