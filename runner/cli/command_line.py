"""The `runner` command line as Hydra gets it: a subcommand's arguments (eval, rerun,
prepare, plan, k8s-manifest) made overrides, the user's config directory, shorthands expanded and
secrets given literally hidden."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runner.cli.conf_files import conf_dir
from runner.cli.evaluate import eval_argv
from runner.cli.k8s_manifest import manifest_argv, manifest_task
from runner.cli.layout_plan import plan_argv, plan_task
from runner.cli.prepare import prepare_argv, prepare_task
from runner.cli.rerun import rerun_argv
from runner.secrets import hide_literal_secrets

USER_CONFIG_ENV = "RUNNER_CONFIG_DIR"
COMMAND_LINE_ENV = "RUNNER_COMMAND_LINE"  # the `runner` command line, as env.json records it
SHORTHANDS = {"init_from": "init_from.path"}  # `key=VALUE` for the main key of a group of keys


def hydra_argv(argv: list[str]) -> tuple[list[str], Callable[[Any], Any] | None]:
    """`argv` (sys.argv) as Hydra reads it, and the task of a subcommand that has one of its
    own (`runner prepare`, `runner k8s-manifest`; None: a run's). Secrets are hidden before
    Hydra keeps the command line (and a launcher plugin pickles it)."""
    task = None
    if argv[1:2] == ["eval"]:
        argv = [argv[0], *eval_argv(argv[2:], Path(conf_dir()))]
    if argv[1:2] == ["rerun"]:
        argv = [argv[0], *rerun_argv(argv[2:], Path(conf_dir()))]
    else:
        if argv[1:2] == ["prepare"]:
            argv, task = [argv[0], *prepare_argv(argv[2:])], prepare_task
        elif argv[1:2] == ["plan"]:
            argv, task = [argv[0], *plan_argv(argv[2:])], plan_task
        elif argv[1:2] == ["k8s-manifest"]:
            argv, task = [argv[0], *manifest_argv(argv[2:])], manifest_task
        if os.environ.get(USER_CONFIG_ENV) and not any(
            a.startswith(("--config-dir", "-cd")) for a in argv[1:]
        ):
            user = user_config_argv(os.environ[USER_CONFIG_ENV])
            argv = [argv[0], *user, *argv[1:]]
    argv = [argv[0], *expand_shorthands(argv[1:])]
    return [argv[0], *hide_literal_secrets(argv[1:], os.environ)], task


def user_config_argv(directory: str) -> list[str]:
    """RUNNER_CONFIG_DIR=DIR: the user's own recipes (DIR/recipe/NAME.yaml) and group options
    (DIR/model/NAME.yaml, ...) next to runner's, like `runner --config-dir DIR`."""
    if not Path(directory).is_dir():
        print(
            f"runner: {USER_CONFIG_ENV}={directory!r}: no such directory "
            "(it should hold GROUP/NAME.yaml files: recipe/, model/, data/, loss/, ...)",
            file=sys.stderr,
        )
        sys.exit(2)
    return [f"--config-dir={directory}"]


def expand_shorthands(args: list[str]) -> list[str]:
    """`init_from=PATH` is `init_from.path=PATH` (a whole `init_from={...}` stays as it is)."""
    expanded = []
    for arg in args:
        key, equals, value = arg.partition("=")
        if equals and key in SHORTHANDS and not value.startswith("{"):
            arg = f"{SHORTHANDS[key]}={value}"
        expanded.append(arg)
    return expanded
