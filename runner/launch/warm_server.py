"""A warm start for many runs in a row: one process imports torch and the agent's modules
once, then forks the agent of every `runner` command that asks for one.

    python -m runner.launch.warm_server /tmp/runner-warm.sock &
    export RUNNER_WARM_SERVER=/tmp/runner-warm.sock

A run's agent otherwise starts as a new interpreter that imports torch, torch._dynamo and
Hydra's instantiate (about 3 CPU-seconds here, most of a short run's cost); forked from this
server it has them already, and so has the fork server it forks for its ranks
(runner.launch.fork_server, whose way of becoming `python -m MODULE ARGS` this reuses: the
command's environment, working directory, standard streams, signals and a session of its
own). The command (runner.cli.warm_start) falls back to a new interpreter whenever this
server cannot serve it: none listening, another Python or another copy of runner, another
cgroup or namespace (a SLURM job step's, a container's), or an environment that differs
from the server's in what a library reads as it loads (OMP_*, TORCH_*, CUDA_*, LD_*, ...).

One SOCK_SEQPACKET connection a process, one JSON message a packet:
  command -> here: {"module", "args", "env", "cwd", "ignored", "executable", "runner",
                   "place", "affinity"} with fds 0, 1, 2 attached
  here -> command: {"pid": N} or {"error": "..."}; then {"exit": C} when it ends
                   (C as subprocess.Popen reports it), and the connection closes.
A command that goes away first leaves its agent a SIGTERM, as the kernel gives a new
interpreter's agent (PR_SET_PDEATHSIG) when its command dies. The server forks only while
it has a single thread and CUDA uninitialized, and never holds a GPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

import runner
from runner.heartbeat import STOP_SIGNALS
from runner.launch import fork_server, forked_ranks
from runner.processes import (
    die_with_parent,
    keep_extensions_in_environment,
    process_place,
    quiet_library_noise,
)

# What the agent imports before it knows the run (runner.launch.torch_setup.import_torch),
# the agent itself, and what its fork server imports for every rank.
PRELOAD = (
    "hydra.utils",
    "torch",
    "torch._dynamo",
    "torch.distributed.elastic.agent.server.api",
    "torch.distributed.launcher.api",
    "runner.launch.agent",
    *fork_server.PRELOAD,
)
# On a host without a GPU, what a CPU run's fork server imports for its ranks besides
# (runner.launch.forked_ranks.modules_for: torch's compiler for a ZeRO or compiled run,
# DeepSpeed with its CPU accelerator), once here: a 12-step 2-rank zero2 run of the mlp,
# 2.7 -> 1.8 CPU-seconds and 2.4 -> 1.5 s. (Where a GPU is seen, not measured: the ranks'.)
CPU_HOST_PRELOAD = (forked_ranks.COMPILER, forked_ranks.DEEPSPEED_ON_CPU)

# Environment a library reads as it loads (thread pools, allocators, torch's flags): a
# request whose values differ from the server's gets a new interpreter instead.
READ_AT_LOAD = (
    "TORCH", "PYTORCH", "OMP_", "MKL_", "OPENBLAS", "GOTO", "KMP_", "CUDA", "NCCL", "NVIDIA",
    "LD_", "MALLOC", "GLIBC", "DS_", "PYTHONHASHSEED", "PYTHONWARNINGS", "PYTHONOPTIMIZE",
    "PYTHONDEVMODE", "PYTHONMALLOC", "PYTHONUTF8", "PYTHONIOENCODING", "PYTHONSAFEPATH",
)  # fmt: skip


# Read by CUDA as it initializes, which no server ever does (it forks only while CUDA is
# uninitialized, and torch counts GPUs through NVML anew each time until then): a sweep's job
# gets its GPUs by CUDA_VISIBLE_DEVICES, and its warm agent sees them as a new interpreter would.
READ_AT_CUDA_INIT = (
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "CUDA_LAUNCH_BLOCKING", "CUDA_MODULE_LOADING",
)  # fmt: skip
# Prefixes only one library reads, as it loads: where the server has not loaded it, a fork
# that does reads the request's own (scikit-learn sets KMP_* for Intel's OpenMP, which a torch
# built with GNU OpenMP never loads; an Optuna sweep passes them to its jobs).
READ_BY_LIBRARY = {"KMP_": "libiomp"}


def mismatch(
    env: dict[str, str],
    own: dict[str, str],
    loaded: dict[str, str] | None = None,
    unread: tuple[str, ...] = (),
) -> str | None:
    """The first variable read at load on which `env` disagrees with `own` (the server's
    environment as its imports saw it), or None. A value a library set as it loaded
    (`loaded`: the server's environment after its imports; torch's compiler sets
    TORCHINDUCTOR_CACHE_DIR to its default) agrees too: a new interpreter given it ends
    where the server's imports did (a command started by a process that imported torch's
    compiler itself passes it on). `unread`: prefixes no library the server loaded reads."""
    loaded = own if loaded is None else loaded
    for key in sorted(set(env) | set(own) | set(loaded)):
        if not key.startswith(READ_AT_LOAD) or key in READ_AT_CUDA_INIT or key.startswith(unread):
            continue
        if env.get(key) not in (own.get(key), loaded.get(key)):
            return key
    return None


class Environment(NamedTuple):
    """The server's environment, as a request is held against it (`mismatch`)."""

    own: dict[str, str]  # as its imports saw it
    loaded: dict[str, str]  # as they left it
    unread: tuple[str, ...]  # prefixes no library it loaded reads


def _sees_a_gpu() -> bool:
    """Whether NVML counts a GPU (PYTORCH_NVML_BASED_CUDA_CHECK: CUDA left uninitialized)."""
    import torch

    return torch.cuda.is_available()


def unread_prefixes() -> tuple[str, ...]:
    """The READ_BY_LIBRARY prefixes whose library this process has not loaded."""
    try:
        with open("/proc/self/maps") as maps:
            mapped = maps.read()
    except OSError:  # not Linux: every prefix counts
        return ()
    return tuple(p for p, library in READ_BY_LIBRARY.items() if library not in mapped)


def serve(path: Path) -> NoReturn:
    """Import, then listen at `path` and fork what each connection asks, until SIGTERM."""
    keep_extensions_in_environment()  # as the `runner` command sets it for its agent
    own = dict(os.environ)  # what the imports saw (a request's own replaces it in the fork)
    for sig in STOP_SIGNALS:  # a forked agent catches them itself (runner.launch.stopping)
        signal.signal(sig, signal.SIG_IGN)
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # never CUDA's runtime here
    quiet_library_noise()
    fork_server._preload(PRELOAD)
    if not _sees_a_gpu():  # every run here is a CPU run: what their fork servers import too
        fork_server._preload(CPU_HOST_PRELOAD)
    loaded = dict(os.environ)  # and what they set in it
    unread = unread_prefixes()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.unlink(missing_ok=True)
    listener.bind(str(staging))
    listener.listen(64)
    os.replace(staging, path)  # listening before anyone can connect: no refused first try
    ours = path.stat().st_ino
    if sys.stderr.isatty():
        print(f"runner warm server: listening at {path} (pid {os.getpid()})", file=sys.stderr)
    try:
        _loop(listener, Environment(own, loaded, unread))
    finally:
        with contextlib.suppress(OSError):
            if path.stat().st_ino == ours:  # not a server's that took the path since
                path.unlink()
    os._exit(0)


def _answering(path: Path) -> bool:
    """Whether a server listens at `path` (a stale socket, a dead server's, does not)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        probe.connect(str(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _loop(listener: socket.socket, environment: Environment) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stop.append(signum))
    waiting: set[socket.socket] = set()  # connected, request not read yet
    children: dict[int, socket.socket | None] = {}  # pid -> its command's connection
    while not stop:
        watched = [listener, wake_r, *waiting, *(c for c in children.values() if c)]
        try:
            ready, _, _ = select.select(watched, [], [])
        except InterruptedError:
            continue
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
        _reap(children)
        for pid, conn in list(children.items()):
            if conn is not None and conn in ready:  # the command is gone (nothing else comes)
                conn.close()
                children[pid] = None
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        if listener in ready:
            with contextlib.suppress(OSError):
                waiting.add(listener.accept()[0])
        for conn in [c for c in ready if c in waiting]:
            waiting.discard(conn)
            closing = (listener.fileno(), wake_r, wake_w, *(c.fileno() for c in waiting))
            closing += tuple(c.fileno() for c in children.values() if c)
            pid = _answer(conn, environment, closing)
            if pid is None:
                conn.close()
            else:
                children[pid] = conn
    for pid in children:  # stopped: what we forked goes with us, as their commands' would
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def _answer(
    conn: socket.socket,
    environment: Environment,
    closing: tuple[int, ...],
) -> int | None:
    """Read a request on `conn` and fork it; the child's pid, or None (refused, or gone)."""
    try:
        data, fds, _, _ = socket.recv_fds(conn, fork_server.MAX_MESSAGE, 3)
    except OSError:
        return None
    try:
        if not data or len(fds) != 3:
            return None
        request = json.loads(data)
        problem = _refusal(request, environment) or fork_server._unsafe_to_fork()
        if problem:
            _send(conn, {"error": problem})
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            # the agent dies with this server, as a new interpreter's dies with its command
            marks = {"RUNNER_PARENT_PID": str(server)}
            fork_server.become(request, fds, (*closing, conn.fileno()), marks, server)
        _send(conn, {"pid": pid})
        return pid
    finally:
        for fd in fds:
            os.close(fd)


def _refusal(request: dict[str, Any], environment: Environment) -> str | None:
    if request.get("executable") != sys.executable:
        return f"another Python ({request.get('executable')}, the server's {sys.executable})"
    if request.get("runner") != os.path.dirname(runner.__file__):
        return f"another copy of runner ({request.get('runner')})"
    if request.get("place") != process_place():
        return "another cgroup or namespace (a job step's, a container's)"
    key = mismatch(request.get("env", {}), *environment)
    if key is not None:
        return f"{key} differs from the server's environment"
    return None


def _reap(children: dict[int, socket.socket | None]) -> None:
    for pid, code in fork_server.reaped():
        conn = children.pop(pid, None)
        if conn is not None:
            _send(conn, {"exit": code})
            conn.close()


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the command went away: it cannot hear us anyway
        conn.send(json.dumps(message).encode())


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m runner.launch.warm_server SOCKET_PATH")
    # First, while the environment is as the interpreter laid it out: setproctitle sets up
    # here what lets each fork show its own command line (an agent's, a rank's: ps, pkill -f)
    fork_server.set_title(f"runner warm server: {sys.argv[1]}")
    parent = os.environ.get("RUNNER_WARM_SERVER_PARENT")  # a test suite's worker, say
    if parent:
        die_with_parent(signal.SIGTERM, int(parent))
    path = Path(sys.argv[1]).absolute()
    if _answering(path):
        print(f"runner warm server: another one listens at {path}; stop it first, or give "
              "this one another path", file=sys.stderr)  # fmt: skip
        sys.exit(2)
    serve(path)


if __name__ == "__main__":
    main()
