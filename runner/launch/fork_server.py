"""The fork server's own process: it imports what every rank needs, once, then forks ranks.

The agent forks it right after importing torch, before the agent has a thread (numpy's
OpenBLAS pool was kept from starting) and long before anything touches CUDA. Here it imports
torch._dynamo (which DDP's constructor pulls in), torch.distributed, Hydra's instantiate and
runner's training modules while the agent waits for the run and starts it; each rank is then a
fork of this process with its own environment, arguments, working directory, standard
streams and session, and runs `python -m MODULE ARGS` the way a new interpreter would.

It talks to the agent over one SOCK_SEQPACKET socket, one JSON message per packet:
  agent -> here: {"op": "preload", "modules": [...]}
                 {"op": "fork", "module", "args", "env", "cwd"} with fds 0, 1, 2 attached
  here -> agent: {"pid": N} or {"error": "..."} for each fork, in order;
                 {"exit": N, "code": C} when a rank ends (C as subprocess.Popen reports it).
It forks only while it has a single thread, and never once CUDA is initialized here.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import io
import json
import os
import runpy
import select
import signal
import socket
import sys
import traceback
from collections.abc import Iterator
from typing import Any, NoReturn

from runner.heartbeat import STOP_SIGNALS
from runner.processes import (
    EXEC_RESET_SIGNALS,
    FORKED_ENV,
    RANK_PARENT_ENV,
    die_with_parent,
    one_blas_thread,
)

# Imported by every rank on any run; importing them here is what the fork server is for.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",
    "hydra.utils",
    "runner.train.trainer",
    "runner.engines.ddp",
)
MAX_MESSAGE = 1 << 20


def serve(conn: socket.socket, agent_pid: int) -> NoReturn:
    """The fork server's life: preload, then answer the agent until it goes away."""
    die_with_parent(signal.SIGKILL, agent_pid)
    # SLURM's --signal reaches every process of the job; a stop is the agent's business.
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the agent decides what a Ctrl-C ends
    # is_available() through NVML, not the CUDA runtime: initializing CUDA here would leave
    # every forked rank without a usable GPU.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    try:
        _preload(PRELOAD)
        _loop(conn)
    except BaseException:  # nothing here may ever return into the agent's code
        traceback.print_exc()
    os._exit(0)


def _loop(conn: socket.socket) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select below
    ranks: set[int] = set()
    while True:
        ready, _, _ = select.select([conn, wake_r], [], [])
        if wake_r in ready:
            with contextlib.suppress(BlockingIOError):
                os.read(wake_r, 4096)
        _reap(conn, ranks)
        if conn not in ready:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
        except ConnectionResetError:  # the agent was killed (SLURM's time limit, SIGKILL)
            return
        if not data:  # the agent is gone, or done with us
            return
        request = json.loads(data)
        if request["op"] == "preload":
            _preload(request["modules"])
            continue
        if not ranks:  # ps names the run this server forks for (not the module: `pkill -f
            set_title(f"runner fork server: {' '.join(request['args'])}")  # MODULE` = ranks)
        problem = _unsafe_to_fork()
        if problem:
            _send(conn, {"error": problem})
            for fd in fds:
                os.close(fd)
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _become_rank(request, fds, closing=(conn.fileno(), wake_r, wake_w))
        for fd in fds:
            os.close(fd)
        ranks.add(pid)
        _send(conn, {"pid": pid})


def _reap(conn: socket.socket, ranks: set[int]) -> None:
    for pid, code in reaped():
        if pid in ranks:
            ranks.discard(pid)
            _send(conn, {"exit": pid, "code": code})


def reaped() -> Iterator[tuple[int, int]]:
    """Each child that has ended, reaped now, with its exit code as subprocess.Popen's."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        yield pid, os.waitstatus_to_exitcode(status)


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the agent went away: it cannot hear us anyway
        conn.send(json.dumps(message).encode())


def _preload(modules: list[str] | tuple[str, ...]) -> None:
    """Import what the ranks will import; a module that fails is the rank's to report.

    Without the cyclic garbage collector, which would walk the growing heap over and over
    (a quarter of the import time here); then every object so far is frozen out of its
    reach, so that a rank's collections never walk torch's modules either, nor write to the
    pages it shares with this process. OpenBLAS as the agent's import of torch kept it: a
    library that loads another copy (scipy's, through transformers' modeling modules) sizes
    its pool from the environment, and a pool would leave the server unfit to fork; each
    rank sizes the pools it inherits from its own environment (_match_blas_threads)."""
    gc.disable()
    try:
        with one_blas_thread():
            for name in modules:
                module, _, attribute = name.partition(":")  # "package:Name": an attribute too
                with contextlib.suppress(Exception):
                    loaded = importlib.import_module(module)
                    if attribute:
                        getattr(loaded, attribute)
    finally:
        gc.enable()
        gc.freeze()


def set_title(title: str) -> None:
    """This process's command line as ps and /proc show it (without setproctitle: as is)."""
    try:
        from setproctitle import setproctitle
    except ImportError:
        return
    setproctitle(title)


def _unsafe_to_fork() -> str | None:
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads > 1:
        return f"the fork server has {threads} threads (an import started one)"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialized in the fork server"
    return None


def _become_rank(request: dict[str, Any], fds: list[int], closing: tuple[int, ...]) -> NoReturn:
    """In the forked child: become `python -u -m MODULE ARGS` as the agent would have started
    it (torch elastic's environment, the agent's working directory and standard streams, a
    session of its own), and never return into the server's loop."""
    parent = os.getppid()
    become(request, fds, closing, {RANK_PARENT_ENV: str(parent), FORKED_ENV: "1"}, parent)


def become(
    request: dict[str, Any],
    fds: list[int],
    closing: tuple[int, ...],
    marks: dict[str, str],
    parent: int,
) -> NoReturn:
    """In a forked child: become `python -u -m MODULE ARGS` as `request` asks (its
    environment, with `marks` set over it, its working directory, the standard streams `fds`,
    a session of its own, SIGKILL when `parent` goes), closing the server's descriptors
    `closing`, and never return into the server's loop (runner.launch.warm_server's too)."""
    code = 1
    try:
        os.setsid()  # torch elastic ends a rank with killpg, as for the ranks it spawns
        signal.set_wakeup_fd(-1)
        for fd in closing:
            os.close(fd)
        # as after exec: what the agent ignores stays ignored, the rest is the default (and
        # SIGINT raises KeyboardInterrupt, as a new interpreter sets it up)
        ignored = {getattr(signal, name) for name in request.get("ignored", ())}
        for sig in EXEC_RESET_SIGNALS:  # (SIGUSR1/2 stay ignored: runner.launch.stopping)
            default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            signal.signal(sig, signal.SIG_IGN if sig in ignored else default)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        _fresh_process_state(request, marks, parent)
        command = [sys.executable, "-u", "-m", request["module"], *request["args"]]
        set_title(" ".join(command))  # what ps shows for a spawned rank
        sys.argv = [request["module"], *request["args"]]
        sys.modules.pop(request["module"], None)  # preloaded (the agent): runpy runs it anew
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _fresh_process_state(request: dict[str, Any], marks: dict[str, str], parent: int) -> None:
    """What a new interpreter would hold that this fork inherited from the server."""
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.update(marks)
    die_with_parent(signal.SIGKILL, parent)
    os.chdir(request["cwd"])
    cores = request.get("affinity")  # the command's cores (the warm server's forks)
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    # sys.path as `python -m` builds it: the working directory, PYTHONPATH, then the rest.
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    base = [p for p in sys.path[1:] if p not in extra]
    sys.path[:] = [os.getcwd(), *extra, *base]
    importlib.invalidate_caches()
    # -u: standard streams without buffers, over the descriptors the agent sent
    for fd, name in ((1, "stdout"), (2, "stderr")):
        old = getattr(sys, name)
        raw = open(fd, "wb", buffering=0, closefd=False)  # noqa: SIM115
        encoding, errors = getattr(old, "encoding", None), getattr(old, "errors", None)
        stream = io.TextIOWrapper(raw, encoding or "utf-8", errors, write_through=True)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    _match_blas_threads()
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # a new interpreter seeds numpy's global generator afresh
        numpy.random.seed()


def _match_blas_threads() -> None:
    """numpy's OpenBLAS sized its thread pool from the environment when the server imported
    it; size it from the rank's (torch.set_num_threads covers OpenMP and MKL)."""
    wanted = os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
    if not wanted or not wanted.isdigit():
        return
    with open("/proc/self/maps") as maps:
        libraries = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    for path in libraries:
        with contextlib.suppress(OSError):
            library = ctypes.CDLL(path)
            for symbol in ("openblas_set_num_threads", "scipy_openblas_set_num_threads64_",
                           "openblas_set_num_threads64_"):  # fmt: skip
                setter = getattr(library, symbol, None)
                if setter is not None:
                    setter(int(wanted))
                    break
