"""The `runner` console script.

It starts the launcher process first, so that the launcher's torch import
(seconds) runs while Hydra composes and checks the config here, then hands over
to runner.cli.main. Time to the first step drops by the parent's own startup.
"""

from __future__ import annotations

import signal
import sys

from runner.cli.interrupts import interrupted, taken


class _Stopped(BaseException):
    """SIGTERM or SIGHUP while no agent runs to take it (run_agent relays it to one)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stopped(signum: int, _frame: object) -> None:
    raise _Stopped(signum)


_command: list[str] = []  # the subcommand typed (Hydra's arguments replace sys.argv)


def _interrupted(signum: int, _frame: object) -> None:
    """Ctrl-C outside a run's agent: KeyboardInterrupt; a second one (`timeout` sends its
    own, a user types it again) while the first unwinds is the same request, ignored, where
    it had broken the unwinding into a traceback (an atexit handler, Hydra's); a third
    interrupts again."""
    taken.append(signum)
    if len(taken) != 2:  # a third: the user insists
        raise KeyboardInterrupt


def main() -> None:
    _command[:] = sys.argv[1:2]
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _stopped)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not ignored
        signal.signal(signal.SIGINT, _interrupted)
    try:
        _main()
    except (KeyboardInterrupt, _Stopped) as stop:  # one line, no traceback
        _say_interrupted(stop.signum if isinstance(stop, _Stopped) else signal.SIGINT)
    except Exception:
        if not interrupted():
            raise
        # a library's code that Ctrl-C cut short in a bad place (a context manager's exit)
        # raised its own error instead: still the interruption
        _say_interrupted(signal.SIGINT)
    finally:
        # the command ends here: a Ctrl-C from now on (a second one, `timeout`'s) would kill
        # the interpreter as it shuts down, by the signal, where it exits with its own code
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _say_interrupted(signum: int) -> None:
    from runner.cli import supervise

    when = "as the run ended" if supervise.agent_ran() else "before any rank started"
    if _command[:1] == ["plan"]:  # a plan starts no rank
        when = "while it planned"
    print(f"runner: interrupted by {signal.Signals(signum).name} {when}", file=sys.stderr)
    sys.exit(128 + signum)


def _main() -> None:
    from runner.cli import planner_process
    from runner.processes import keep_extensions_in_environment

    keep_extensions_in_environment()  # before any process starts: every one inherits it
    planner_process.prestart(sys.argv[1:])  # its torch import overlaps all that follows
    from runner.cli import torch_release

    torch_release.check()  # an image's torch older than runner supports: one line, exit 2
    if sys.argv[1:2] == ["export"]:  # no run: no agent to prestart, no Hydra
        from runner.export.command import main as export_main

        sys.exit(export_main(sys.argv[2:]))
    from runner.cli import supervise

    supervise.catch_early_asks()
    supervise.prestart_agent(sys.argv[1:])
    from runner.cli.main import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
