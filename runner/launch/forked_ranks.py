"""Ranks forked from a process that has already imported torch (start_method=forkserver).

A new interpreter per rank spends seconds importing torch and, through DDP's constructor,
torch._dynamo, before it does anything of its own. The agent imports torch (while the parent
composes the config) and then, before it has a thread, forks a fork server
(runner.launch.fork_server); the server imports the rest once, while the agent waits for the run
and starts it, and every rank (and every elastic restart) is a fork of it. Torch elastic
still runs the ranks: the handler it uses to start a rank asks the fork server instead of
`subprocess.Popen` (`forked_ranks`), and gets back a handle that behaves like Popen's.

Where a fork would be unsafe the ranks are spawned as before: on any system but Linux
(macOS' system libraries and Windows do not survive a fork), when the fork server holds a
thread or an initialized CUDA context, and when torch elastic's process-start hook is not
where this version expects it. A rank forked this way differs from a spawned one only in
what was imported before it started: its environment, arguments, working directory,
standard streams, session, signals, numpy seed and OpenBLAS threads are set as a new
interpreter would have them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from runner.launch import fork_server
from runner.processes import ignored_signals
from runner.spec import RunSpec
from runner.spec.parallelism_specs import DEEPSPEED_SPECS

log = logging.getLogger("runner")


def modules_for(spec: RunSpec) -> list[str]:
    """What this run's ranks import beyond fork_server.PRELOAD and the server may import too:
    the modules of runner's and torchvision's components it names, what the model's family
    says its ranks import (torchvision for runner's resnets, on the CPU a transformers model
    class: runner.models.families), torch's compiler for the ranks that import it (see
    _imports_the_compiler; on a GPU they stay the ranks' to import: whether the imports leave
    the server fit to fork there has not been measured), and DeepSpeed on the CPU, with the
    CPU accelerator a CPU rank picks (on a GPU DeepSpeed picks its accelerator as it loads:
    the ranks' to import). Not the user's code: what it does on import is unknown."""
    targets = [spec.model.target, spec.data.target, spec.loss.target]
    targets += [metric.target for metric in spec.metrics.values()]
    modules = [t.rpartition(".")[0] for t in targets if t.split(".")[0] in _SAFE_PACKAGES]
    from runner.models.families import family_of_target

    modules += family_of_target(spec.model.target).preloads(spec.model.target, spec.device)
    if _imports_the_compiler(spec):
        modules.append(COMPILER)
    if spec.device == "cpu" and isinstance(spec.parallelism, DEEPSPEED_SPECS):
        modules.append(DEEPSPEED_ON_CPU)
    return list(dict.fromkeys(m for m in modules if m))


# torch.compile's default backend, which each rank of a compiled or DeepSpeed run imports
# (DeepSpeed's ZeRO optimizer check imports its Muon optimizer, which calls torch.compile as
# it loads): 1.3-1.8 s of CPU per rank and per restart here, once in the fork server.
COMPILER = "torch._inductor.compile_fx"
DEEPSPEED_ON_CPU = "runner.engines.deepspeed_on_cpu"


def _imports_the_compiler(spec: RunSpec) -> bool:
    """Whether the ranks import torch's compiler, on a CPU run. (On a GPU it stays theirs to
    import: whether the import leaves the server fit to fork there has not been measured.)"""
    if spec.device != "cpu":
        return False
    return spec.compile is not None or isinstance(spec.parallelism, DEEPSPEED_SPECS)


_SAFE_PACKAGES = ("runner", "torchvision")


class ForkServerError(RuntimeError):
    """The fork server cannot start a rank (gone, or unsafe to fork): spawn it instead."""


class ForkServer:
    """The agent's end of the fork server. `start()` before any thread exists."""

    def __init__(self, pid: int, conn: socket.socket):
        self.pid = pid
        self._conn = conn
        self._lock = threading.Lock()
        self._exits: dict[int, int] = {}
        self._replies: list[dict[str, Any]] = []
        self._gone = False

    @classmethod
    def start(cls) -> ForkServer:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        agent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            ours.close()
            fork_server.serve(theirs, agent)
        theirs.close()
        return cls(pid, ours)

    def preload(self, modules: Sequence[str]) -> None:
        """Have the server import these too (what this run's ranks need beyond the usual)."""
        if modules:
            self._request({"op": "preload", "modules": list(modules)})

    def spawn(self, args: Sequence[str], env: dict[str, str]) -> ForkedRank:
        """Start `python [-u] -m MODULE ARGS...` (torch elastic's command line) as a fork."""
        module, rest = _module_command(args)
        # exec keeps an ignored signal ignored (a job started in the background ignores SIGINT)
        ignored = ignored_signals()
        message = {"op": "fork", "module": module, "args": rest, "env": env, "cwd": os.getcwd()}
        message["ignored"] = ignored
        with self._lock:
            self._request(message, fds=[0, 1, 2])
            while not self._replies:
                self._receive(block=True)
            reply = self._replies.pop(0)
        if "error" in reply:
            raise ForkServerError(reply["error"])
        return ForkedRank(self, int(reply["pid"]), args)

    def returncode(self, pid: int, timeout: float = 0.0) -> int | None:
        """The rank's exit code once the server reaped it, waiting up to `timeout` seconds."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                self._receive(block=False)
                if pid in self._exits or self._gone:
                    # a server that died took its ranks with it (PR_SET_PDEATHSIG)
                    return self._exits.get(pid, -signal.SIGKILL)
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                select.select([self._conn], [], [], left)

    def close(self) -> None:
        """End the server (it has no ranks left) and reap it."""
        with contextlib.suppress(OSError):
            self._conn.close()
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(self.pid, os.WNOHANG)[0] != 0:
                    return
            time.sleep(0.01)
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)

    def _request(self, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
        if self._gone:
            raise ForkServerError("the fork server is gone")
        try:
            socket.send_fds(self._conn, [json.dumps(message).encode()], list(fds))
        except OSError as exc:
            self._gone = True
            raise ForkServerError(f"the fork server is gone ({exc})") from None

    def _receive(self, block: bool) -> None:
        """Read what the server sent: fork replies and exit notes."""
        while not self._gone:
            if not block and not select.select([self._conn], [], [], 0)[0]:
                return
            try:
                data = self._conn.recv(fork_server.MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                self._gone = True
                self._replies.append({"error": "the fork server ended"})
                return
            message = json.loads(data)
            if "exit" in message:
                self._exits[int(message["exit"])] = int(message["code"])
            else:
                self._replies.append(message)
            block = False


def _module_command(args: Sequence[str]) -> tuple[str, list[str]]:
    """MODULE and ARGS of `python [-u] -m MODULE ARGS...`; anything else is spawned."""
    words = list(args)
    if not words or words[0] != sys.executable:
        raise ForkServerError(f"not a command of this interpreter: {words[:1]}")
    words = words[1:]
    while words and words[0] == "-u":  # the fork's streams are unbuffered anyway
        words = words[1:]
    if len(words) < 2 or words[0] != "-m":
        raise ForkServerError(f"not a `python -m MODULE` command: {list(args)}")
    return words[1], words[2:]


class ForkedRank:
    """What torch elastic keeps of a process it started (subprocess.Popen's `pid`, `poll`,
    `wait`, `returncode`, `args`), for a rank the fork server forked."""

    def __init__(self, server: ForkServer, pid: int, args: Sequence[str]):
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._server = server

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.returncode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.returncode(self.pid, 1e9 if timeout is None else timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


Started = Callable[[dict[str, str], Any], None]  # (a rank's environment, its process)


@contextlib.contextmanager
def forked_ranks(server: ForkServer | None, started: Started | None = None) -> Iterator[bool]:
    """While inside, torch elastic starts ranks through `server` (None: spawns them), and
    tells `started` of each process it starts (its exit code is read from it once torch has
    seen it end: runner.launch.restarts). Yields whether it forks them."""
    hook = elastic_hook() if server is not None or started is not None else None
    if hook is None:
        yield False
        return
    api, handler_class = hook
    warned: list[str] = []

    class RankHandler(handler_class):  # type: ignore[misc, valid-type]
        def _popen(self, args: tuple, env: dict[str, str]) -> Any:
            process = None
            if server is not None:
                try:
                    process = server.spawn(args, env)
                except ForkServerError as exc:
                    if not warned:
                        warned.append(str(exc))
                        log.warning("runner: spawning the ranks instead of forking them: %s", exc)
            if process is None:
                process = super()._popen(args, env)
            if started is not None:
                started(env, process)
            return process

        def close(self, death_sig: signal.Signals | None = None) -> None:
            try:
                super().close(death_sig)
            except ProcessLookupError:  # forked a moment ago: not yet its own process group
                self.proc.send_signal(death_sig or signal.SIGTERM)

    def make_handler(*args: Any, **kwargs: Any) -> Any:
        return RankHandler(*args, **kwargs)

    original = api.get_subprocess_handler
    api.get_subprocess_handler = make_handler
    try:
        yield server is not None
    finally:
        api.get_subprocess_handler = original


def elastic_hook() -> tuple[Any, type] | None:
    """torch elastic's module that starts binaries, and the handler class it uses."""
    try:
        from torch.distributed.elastic.multiprocessing import api
        from torch.distributed.elastic.multiprocessing.subprocess_handler import (
            SubprocessHandler,
        )
    except ImportError:
        return None
    if not callable(getattr(api, "get_subprocess_handler", None)):
        return None
    if not callable(getattr(SubprocessHandler, "_popen", None)):
        return None
    return api, SubprocessHandler
