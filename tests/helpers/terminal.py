"""Running a command as a user types it: in a pseudo-terminal of its own (so the progress bar
draws, and Ctrl-C is the terminal's: SIGINT to the foreground process group), from an
activated venv (`runner` found on PATH) or as `.venv/bin/runner` with the venv off PATH."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import signal
import struct
import sys
import termios
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import cost
from tests.helpers.cli import HANG, REPO

VENV_BIN = Path(sys.executable).parent
SYSTEM_PATH = "/usr/local/bin:/usr/bin:/bin"
CTRL_C = b"\x03"


@dataclass
class Typed:
    returncode: int
    output: str  # what the terminal showed (carriage returns and escapes included)

    @property
    def lines(self) -> list[str]:
        """The terminal's lines as a user reads them: each carriage return redraws its line."""
        return [line.rsplit("\r", 1)[-1] for line in self.output.replace("\r\n", "\n").split("\n")]


def shell_env(activated: bool) -> dict[str, str]:
    """The environment of a shell where the venv is activated, or not."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "OMP_NUM_THREADS")}
    env.update(TERM="xterm", COLUMNS="120", LINES="40")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])  # test helpers
    if activated:
        env.update(PATH=f"{VENV_BIN}{os.pathsep}{SYSTEM_PATH}", VIRTUAL_ENV=sys.prefix)
    else:
        env["PATH"] = SYSTEM_PATH
    return env


def command(name: str, activated: bool) -> str:
    """`runner` as typed: found on PATH in an activated venv, else by its path."""
    return name if activated else str(VENV_BIN / name)


def type_in(
    argv: list[str],
    cwd: Path,
    activated: bool,
    keys: tuple[Callable[[str], bool], bytes | int] | None = None,
    timeout: float = HANG,
) -> Typed:
    """Run `argv` in a new pseudo-terminal (120 columns) until it exits; `keys`: once the
    output so far satisfies the test, type these bytes (Ctrl-C: CTRL_C), or send the command
    this signal (an int: SIGTERM, as `kill` or a scheduler does)."""
    env = shell_env(activated)
    cost.note_started(argv)
    pid, fd = pty.fork()
    if pid == 0:  # the child: a session of its own, the terminal its controlling one
        try:
            # as an interactive shell starts a command: Ctrl-C and Ctrl-\ at their defaults,
            # whatever this process inherited (a background job of a script ignores both)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.signal(signal.SIGQUIT, signal.SIG_DFL)
            os.chdir(cwd)
            os.execvpe(argv[0], argv, env)
        finally:
            os._exit(127)
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    output = bytearray()
    started = False  # the command runs (exec'd): until then, a Ctrl-C reaches only the fork
    deadline = time.monotonic() + timeout
    try:
        while True:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                raise AssertionError(f"{argv} did not end in {timeout} s:\n{output.decode()}")
            ready, _, _ = select.select([fd], [], [], 0.02)
            if ready:
                try:
                    data = os.read(fd, 65536)
                except OSError:  # EIO: every process holding the terminal is gone
                    break
                if not data:
                    break
                output += data
            started = started or _has_exec(pid, argv[0])  # a key before it is the fork's
            if keys is not None and started and keys[0](output.decode(errors="replace")):
                if isinstance(keys[1], int):
                    os.kill(pid, keys[1])
                else:
                    os.write(fd, keys[1])
                keys = None
    finally:
        os.close(fd)
        _, status = os.waitpid(pid, 0)
    return Typed(os.waitstatus_to_exitcode(status), output.decode(errors="replace"))


def _has_exec(pid: int, program: str) -> bool:
    """Whether the forked child runs `program` yet. A key typed before its exec would reach
    a copy of this test process, whose Python handler takes the SIGINT and loses it as the
    image is replaced: a race of the harness, not of the command."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return os.path.basename(program).encode() in f.read()
    except OSError:
        return True  # gone already (or no /proc): nothing to wait for
