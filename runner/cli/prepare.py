"""`runner prepare [overrides] [--rebuild] [--verify]`: build the data's cache ahead of a run.

For a CPU node before a GPU job, or once before a sweep or a multi-node run: the overrides
a run takes compose the same data, and the cache built here is the one the run finds. The
parent composes and checks the config as for a run (no torch, exit 2 on bad input); a
child process (`python -m runner.data.prepare`) builds, its progress on this terminal.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from omegaconf import DictConfig

from runner.cli.conf_files import conf_dir
from runner.cli.layout_plan import apply_layout, wants_plan
from runner.secrets import SECRETS_ENV
from runner.spec import SpecError, save_spec
from runner.spec.composed import problems_text, resolve_cfg

FLAGS = ("--rebuild", "--verify")
log = logging.getLogger("runner")


class _Request:
    flags: list[str] = []
    workdir: str = ""


def prepare_argv(args: list[str]) -> list[str]:
    """Hydra's arguments for `runner prepare ARGS`: the run's overrides, and a temporary run
    directory that nothing is written to but the resolved config the child reads."""
    _Request.flags = [a for a in args if a in FLAGS]
    _Request.workdir = tempfile.mkdtemp(prefix="runner-prepare-")
    atexit.register(shutil.rmtree, _Request.workdir, True)
    rest = [a for a in args if a not in FLAGS]
    return [*rest, f"hydra.run.dir={_Request.workdir}", "hydra.output_subdir=null"]


def prepare_task(cfg: DictConfig) -> None:
    """Hydra's task for `runner prepare`: check the config, then build in a child."""
    workdir = Path(_Request.workdir)
    if wants_plan(cfg):  # the data is the same under every layout
        apply_layout(cfg, {"parallelism": "ddp", "activation_checkpointing": "none"}, conf_dir())
    try:
        spec, secrets = resolve_cfg(cfg, workdir)
    except SpecError as err:
        log.error("%s", problems_text(err.problems))
        sys.exit(2)
    save_spec(spec, workdir, secrets)
    os.environ[SECRETS_ENV] = secrets.environment()  # the child reads config.yaml
    child = [sys.executable, "-m", "runner.data.prepare", str(workdir), *_Request.flags]
    sys.exit(subprocess.call(child))
