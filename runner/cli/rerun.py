"""`runner rerun RUN_DIR [KEY=VALUE ...]`: run a finished run again from its config.yaml.

The run's resolved config becomes a temporary primary config (Hydra's
`--config-dir`/`--config-name`), so the new run gets the same values whatever
the config files and recipes say today, its own run directory, and Hydra's
usual treatment of further overrides.
"""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

from runner.components import TARGET
from runner.spec.config_file import ConfigDamaged, read_config

GROUPS = (
    "model",
    "data",
    "loss",
    "metrics",
    "optimizer",
    "scheduler",
    "parallelism",
    "launcher",
    "sync_strategy",
    "precision",
    "logger",
)


def _option(conf_dir: Path, group: str, node: dict) -> str | list[str]:
    """The group option a resolved node came from: its `name`, or for a component the
    shipped option with the same `_target_` (else `custom`; metrics: `none`); for the
    logger, the options selected."""
    if group == "logger":  # any number of options: the keys of the node
        return list(node) or "none"
    if "name" in node:
        return node["name"]
    if group == "metrics":
        return "none"
    for path in sorted((conf_dir / group).glob("*.yaml")):
        if (yaml.safe_load(path.read_text()) or {}).get(TARGET) == node.get(TARGET):
            return path.stem
    return "custom"


def rerun_config(run_dir: Path, conf_dir: Path, switched: dict[str, str] | None = None) -> str:
    """A primary config that reproduces the run in `run_dir` from its resolved config.yaml.

    Its defaults pick the options the run used and its own values are the run's resolved
    values, so later edits of the config files or recipes change nothing. The run starts
    fresh (resume=null) in a new run directory. A group `switched` to another option on the
    command line (`parallelism=fsdp`) gets that option's values, not the run's.
    """
    switched = switched or {}
    spec = read_config(run_dir / "config.yaml")
    spec["resume"] = None
    for group, option in switched.items():
        if group in spec and option != _option(conf_dir, group, spec[group]):
            del spec[group]  # another option: its own settings, not the run's
    if "parallelism" not in spec and "sync_strategy" not in switched:
        spec["sync_strategy"] = {"name": "auto"}  # the run's followed its parallelism
    if "tensorboard" in spec:  # a run from before the logger group
        spec["logger"] = {"tensorboard": {}} if spec.pop("tensorboard") else {}
    primary = yaml.safe_load((conf_dir / "config.yaml").read_text())
    defaults = [{group: _option(conf_dir, group, spec[group])} for group in GROUPS if group in spec]
    defaults += [{group: "???"} for group in GROUPS if group not in spec]  # the command line's
    hydra_defaults = [  # runner's help text and log format
        d for d in primary["defaults"] if isinstance(d, dict) and "override hydra/" in str(d)
    ]
    document = {
        "defaults": [*defaults, "_self_", *hydra_defaults],
        **spec,
        "hydra": primary["hydra"],
    }
    return yaml.safe_dump(document, sort_keys=False)


def rerun_argv(argv: list[str], conf_dir: Path) -> list[str]:
    """`runner rerun RUN_DIR [KEY=VALUE ...]` as Hydra arguments."""
    if len(argv) < 1 or argv[0].startswith("-") or "=" in argv[0]:
        sys.exit("usage: runner rerun RUN_DIR [KEY=VALUE ...]")
    run_dir = Path(argv[0])
    if not (run_dir / "config.yaml").is_file():
        print(
            f"runner rerun: {run_dir} has no config.yaml; give a run directory "
            "(runs/<timestamp>, or a sweep job's directory)",
            file=sys.stderr,
        )
        sys.exit(2)
    config_dir = Path(tempfile.mkdtemp(prefix="runner-rerun-"))
    atexit.register(shutil.rmtree, config_dir, ignore_errors=True)
    switched = {
        group: option
        for group, equals, option in (arg.partition("=") for arg in argv[1:])
        if equals and group in GROUPS
    }
    try:
        primary = rerun_config(run_dir, conf_dir, switched)
    except ConfigDamaged as exc:
        print(f"runner rerun: {exc}; nothing to run again from", file=sys.stderr)
        sys.exit(2)
    (config_dir / "rerun.yaml").write_text(primary)
    return [f"--config-dir={config_dir}", "--config-name=rerun", *argv[1:]]
