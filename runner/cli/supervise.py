"""The parent's side of a launch: start the agent process, relay signals, wait.

The agent (runner.launch.agent) runs in its own session so that Ctrl-C reaches it
exactly once, through us. A second Ctrl-C (not the same key press delivered twice, as
`timeout -s INT` adds its own to a terminal's: SAME_PRESS_S apart), or an agent that does
not stop in time, gets SIGKILL; the ranks die with it (they hold PR_SET_PDEATHSIG), and
their heartbeats still say the last step every rank finished (AgentEnd.reached).

The `runner` command starts the agent before anything else (`prestart_agent`):
it imports torch while this process composes and checks the config, and waits
on its stdin for the run directory. Unused (a config error, --help), it is
killed at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner import heartbeat
from runner.cli import warm_start
from runner.heartbeat import STOP_SIGNALS
from runner.processes import START_METHOD_ENV, exit_code_for_signal
from runner.secrets import SECRETS_ENV

GRACE_S = 20.0
SAME_PRESS_S = 1.0  # a signal this soon after the first is the same request, delivered twice
Agent = subprocess.Popen | warm_start.WarmProcess  # a new interpreter, or a warm fork


class _Relay:
    """Forwards the first signal to the agent; a second one, or a slow agent, gets SIGKILL."""

    def __init__(self, agent: Agent):
        self.agent = agent
        self.first: int | None = None
        self.since = 0.0

    def __call__(self, signum: int, _frame: object) -> None:
        if self.first is not None:
            if time.monotonic() - self.since > SAME_PRESS_S:
                _kill(self.agent)
            return
        self.first, self.since = signum, time.monotonic()
        _send(self.agent, signum)

    def overdue(self) -> bool:
        return self.first is not None and time.monotonic() - self.since > GRACE_S


_NO_RUN_FLAGS = (
    "-m", "--multirun", "-h", "--help", "--hydra-help", "-c", "--cfg", "-i", "--info",
    "-sc", "--shell-completion", "--version", "-p", "--package", "--resolve",
)  # fmt: skip
_prestarted: Agent | None = None


def prestart_agent(argv: list[str]) -> None:
    """Start the agent now, when `argv` asks for a single run (not a sweep: its jobs may run
    elsewhere; not --help, --cfg and friends: nothing runs)."""
    global _prestarted
    no_run = argv[:1] in (["prepare"], ["k8s-manifest"], ["plan"])
    if no_run or any(arg.split("=")[0] in _NO_RUN_FLAGS for arg in argv):
        return
    env = {**os.environ, "RUNNER_PARENT_PID": str(os.getpid())}
    for arg in argv:  # the agent forks its fork server first thing, unless told otherwise
        key, _, value = arg.lstrip("+~").partition("=")
        if key == "start_method":
            env[START_METHOD_ENV] = value
    _prestarted = warm_start.start("runner.launch.agent", ["-"], env, pipes=1)
    if _prestarted is None:  # no warm server (runner.launch.warm_server): a new interpreter
        _prestarted = subprocess.Popen(
            [sys.executable, "-m", "runner.launch.agent", "-"],
            env=env,
            stdin=subprocess.PIPE,
            start_new_session=True,
        )
    atexit.register(_discard_prestarted)


def _discard_prestarted() -> None:
    if _prestarted is not None and _prestarted.poll() is None:
        _kill(_prestarted)
        _prestarted.wait()


def _start_agent(run_dir: Path, start_time: float, secrets: str) -> Agent:
    """The prestarted agent, told where the run is and the secrets kept out of its files
    (runner.secrets); else a new one."""
    global _prestarted
    agent, _prestarted = _prestarted, None
    if agent is not None and agent.poll() is None and agent.stdin is not None:
        try:
            agent.stdin.write(f"{run_dir}\t{start_time!r}\t{secrets}\n".encode())
            agent.stdin.close()
            return agent
        except OSError:  # it died on the way: start another
            _kill(agent)
    env = dict(os.environ)
    env["RUNNER_START_TIME"] = repr(start_time)
    env["RUNNER_PARENT_PID"] = str(os.getpid())
    env[SECRETS_ENV] = secrets
    warm = warm_start.start("runner.launch.agent", [str(run_dir)], env)
    if warm is not None:
        return warm
    return subprocess.Popen(
        [sys.executable, "-m", "runner.launch.agent", str(run_dir)], env=env, start_new_session=True
    )


class _Asks:
    """Forwards SIGUSR1/SIGUSR2 (a graceful stop, runner.launch.stopping) to the agent, each
    time: they ask it to stop after a step with a checkpoint, and arm no kill."""

    def __init__(self, agent: Agent):
        self.agent = agent
        self.first: int | None = None

    def __call__(self, signum: int, _frame: object) -> None:
        self.first = self.first or signum
        _send(self.agent, signum)


@dataclass(frozen=True)
class AgentEnd:
    """How the agent ended: its exit code; the interrupting signal relayed (SIGINT, SIGTERM,
    SIGHUP), if any; the signal that asked for a graceful stop, if any, and the handler
    something else had installed for it here (submitit's, which requeues its job)."""

    code: int
    received: int | None = None
    asked: int | None = None
    asked_handler: Callable[..., Any] | None = None
    reached: int | None = None  # killed: the last step every rank had finished (heartbeats)


_ran: list[int] = []  # the agents this process ran


def agent_ran() -> bool:
    """Whether this process has run an agent (a run, or a sweep's job)."""
    return bool(_ran)


def run_agent(run_dir: Path, start_time: float, secrets: str = "{}") -> AgentEnd:
    """Run the agent for `run_dir` to the end, relaying signals to it. `secrets`: the values
    config.yaml masks, as JSON (runner.secrets)."""
    agent = _start_agent(run_dir, start_time, secrets)
    _ran.append(agent.pid)
    relay, asks = _Relay(agent), _Asks(agent)
    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, relay) for s in handled}
    previous.update({s: signal.signal(s, asks) for s in STOP_SIGNALS})
    for signum in _asked_early:  # before the agent existed (once: not for a sweep's next job)
        asks(signum, None)
    _asked_early.clear()
    try:
        while True:
            try:
                code = agent.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if relay.overdue():
                    _kill(agent)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    reached = None
    if code < 0:  # killed (SIGKILL: the OOM killer, a scheduler): its heartbeat file stayed
        reached = heartbeat.finished_step_of(agent.pid)
        heartbeat.sweep_stale(agent.pid)
    if relay.first is not None and code < 0:
        code = exit_code_for_signal(relay.first)
    elif code < 0:  # ended by a signal no one relayed: the shell's code for it, not 256 - n
        code = exit_code_for_signal(-code)
    handler = previous.get(asks.first) if asks.first else None
    others = handler if callable(handler) and handler is not _note_early_ask else None
    return AgentEnd(code, relay.first, asks.first, others, reached)


_asked_early: list[int] = []


def _note_early_ask(signum: int, _frame: object) -> None:
    _asked_early.append(signum)


def catch_early_asks() -> None:
    """From the `runner` command's start: a SIGUSR1/SIGUSR2 (SLURM's --signal) that comes
    while the config is composed is kept for the agent, not the end of this process."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _note_early_ask)


def _send(proc: Agent, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signum)


def _kill(proc: Agent) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        _send(proc, signal.SIGKILL)
