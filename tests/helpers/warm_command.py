"""`python -m tests.helpers.warm_command ARGS`: the `runner ARGS` command, in a fork of the
suite's warm server (tests/helpers/cli.run_cli), ending as an interpreter ends: its exit
handlers run (the command's own: a prestarted agent or planner ended, temporary directories
removed), which the server's forks otherwise skip. Everything else is the command's own code,
run as `python -m runner.cli.entry ARGS` runs it."""

from __future__ import annotations

import atexit
import runpy


def main() -> None:
    try:
        runpy.run_module("runner.cli.entry", run_name="__main__", alter_sys=True)
    finally:
        atexit._run_exitfuncs()


if __name__ == "__main__":
    main()
