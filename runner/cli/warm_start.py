"""The command's side of a warm start (runner.launch.warm_server): where RUNNER_WARM_SERVER
names a listening server, the agent is a fork of it, torch already imported, instead of a
new interpreter. Anything that keeps the server from serving (none listening, another Python,
another environment) leaves the command to start a new interpreter, as without one.
Nothing here imports more than the standard library."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from runner.processes import WARM_SERVER_ENV, ignored_signals, process_place

FALLBACK = "runner: the warm server does not serve this command"  # said on stderr, then why
_ANSWER_S = 30.0  # a server that takes longer to fork is stuck: a new interpreter instead


class WarmProcess:
    """A process the warm server forked: what `runner` uses of subprocess.Popen's handle."""

    def __init__(self, conn: socket.socket, pid: int, args: Sequence[str], pipes: list[int]):
        self._conn = conn
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self.stdin = os.fdopen(pipes[0], "wb") if pipes else None
        self._outputs = pipes[1:]  # stdout's and stderr's read ends, where they are pipes

    def communicate(self, text: str, timeout: float | None = None) -> tuple[str, str]:
        """Write `text` to stdin, read stdout and stderr to their ends, wait (Popen's, text);
        subprocess.TimeoutExpired after `timeout` seconds, the process left running."""
        assert self.stdin is not None and len(self._outputs) == 2
        deadline = None if timeout is None else time.monotonic() + timeout
        with contextlib.suppress(BrokenPipeError):
            self.stdin.write(text.encode())
        with contextlib.suppress(BrokenPipeError):
            self.stdin.close()
        read: dict[int, list[bytes]] = {fd: [] for fd in self._outputs}
        open_fds = list(self._outputs)
        while open_fds:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                for fd in open_fds:
                    os.close(fd)
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            for fd in select.select(open_fds, [], [], left)[0]:
                chunk = os.read(fd, 65536)
                if chunk:
                    read[fd].append(chunk)
                else:
                    open_fds.remove(fd)
                    os.close(fd)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        out, err = (b"".join(read[fd]).decode(errors="replace") for fd in self._outputs)
        return out, err

    def poll(self) -> int | None:
        self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._read(left)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        ready, _, _ = select.select([self._conn], [], [], timeout)
        if not ready:
            return
        try:
            data = self._conn.recv(4096)
        except OSError:
            data = b""
        if data:
            self.returncode = int(json.loads(data)["exit"])
        else:  # the server died (its agents get SIGTERM with it): wait for ours to be gone
            print(f"runner: the warm server ended; {self.args[2]} (pid {self.pid}), its fork, "
                  "stops with it (SIGTERM)", file=sys.stderr, flush=True)  # fmt: skip
            while _alive(self.pid):
                time.sleep(0.05)
            self.returncode = -signal.SIGTERM
        self._conn.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as stat:
        return stat.read().rpartition(")")[2].split()[0] != "Z"  # a zombie is gone for us
    return True


def start(
    module: str,
    args: Sequence[str],
    env: dict[str, str],
    pipes: int = 0,
    cwd: str | None = None,
) -> WarmProcess | None:
    """`python -m MODULE ARGS` in `env`, forked by the warm server with this process's
    working directory (or `cwd`) and standard streams (the first `pipes` of stdin, stdout
    and stderr new pipes instead), in a session of its own; None where no server serves it."""
    path = env.get(WARM_SERVER_ENV)
    if not path:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    theirs, ours = [0, 1, 2], []
    try:
        conn.connect(path)
        for fd in range(pipes):
            read_end, write_end = os.pipe()
            theirs[fd], mine = (read_end, write_end) if fd == 0 else (write_end, read_end)
            ours.append(mine)
        message = {"module": module, "args": list(args), "env": env, "cwd": cwd or os.getcwd()}
        message.update(ignored=ignored_signals(), executable=sys.executable, runner=_runner_dir())
        message["place"] = process_place()
        if hasattr(os, "sched_getaffinity"):  # a sweep's job pinned to its slot's cores
            message["affinity"] = sorted(os.sched_getaffinity(0))
        sys.stdout.flush()
        sys.stderr.flush()
        socket.send_fds(conn, [json.dumps(message).encode()], theirs)
        ready, _, _ = select.select([conn], [], [], _ANSWER_S)
        reply = json.loads(conn.recv(4096) or b'{"error": "the server went away"}') if ready else {}
    except (OSError, ValueError) as exc:
        reply = {"error": f"no warm server at {path} ({exc})"}
    finally:
        for fd in theirs[:pipes]:
            os.close(fd)
    if "pid" not in reply:  # reply["error"] says why (no server, another environment, ...)
        conn.close()
        for fd in ours:
            os.close(fd)
        # said once a command: a fallback costs seconds of CPU, which a user who named the
        # server would not know of otherwise
        why = reply.get("error", "it did not answer")
        print(f"{FALLBACK}: {why}; a new interpreter instead ({WARM_SERVER_ENV}={path})",
              file=sys.stderr)  # fmt: skip
        return None
    return WarmProcess(conn, int(reply["pid"]), [sys.executable, "-m", module, *args], ours)


def _runner_dir() -> str:
    import runner

    return os.path.dirname(runner.__file__)
