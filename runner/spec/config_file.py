"""config.yaml: the resolved spec a run directory holds, written by the parent and read by
every rank (and by `runner rerun`), with the configs of older runs migrated on the way in."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from runner.components import TARGET
from runner.secrets import Secrets, restore
from runner.spec.convert import from_dict, to_dict
from runner.spec.schema import (
    RunSpec,
)

CONFIG_FILE = "config.yaml"
# The first line says the file is sealed; the last holds the digest of everything above it,
# so a truncated file (a valid YAML mapping, with keys missing) or one with bytes changed is
# found, not read as a config with defaults in place of what was cut. Files of older runs
# have neither line and are read as they are.
HEADER = "# runner: a run's resolved config; the last line seals it (sha1 of the lines above)\n"
SEAL = "# sha1 "


class ConfigDamaged(ValueError):
    """config.yaml does not hold what runner wrote."""


def save_spec(spec: RunSpec, run_dir: str | Path, secrets: Secrets | None = None) -> Path:
    """Write the resolved spec as `config.yaml` (atomically) and return its path; `secrets`:
    what stays a placeholder or is masked there (runner.secrets)."""
    path = Path(run_dir) / CONFIG_FILE
    tmp = path.with_suffix(".yaml.tmp")
    config = to_dict(spec)
    body = HEADER + yaml.safe_dump(secrets.written(config) if secrets else config, sort_keys=False)
    tmp.write_text(f"{body}{SEAL}{hashlib.sha1(body.encode()).hexdigest()}\n")
    os.replace(tmp, path)
    return path


def read_config(path: Path) -> dict[str, Any]:
    """A config.yaml's mapping, once its seal says it is whole. Raises ConfigDamaged, naming
    the file, where it is not (OSError where it cannot be read at all)."""
    text = path.read_bytes().decode(errors="replace")
    if text.startswith(HEADER):
        body, _, last = text.rstrip("\n").rpartition("\n")
        body += "\n"
        if not last.startswith(SEAL):
            raise ConfigDamaged(f"{path} is cut short (its last line, the seal, is missing)")
        if last[len(SEAL) :].strip() != hashlib.sha1(body.encode()).hexdigest():
            raise ConfigDamaged(f"{path} does not hold what was written (its digest differs)")
        text = body
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigDamaged(f"{path} is not readable YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(config, dict):
        raise ConfigDamaged(f"{path} holds no config (a mapping of keys)")
    return config


def load_spec(run_dir: str | Path) -> RunSpec:
    """Read the resolved spec of a run directory (what every rank does first): its
    placeholders resolved from this process's environment, its masked secrets from what
    the parent handed down."""
    return from_dict(RunSpec, migrate(restore(written_config(run_dir), os.environ)))


def written_config(run_dir: str | Path) -> dict[str, Any]:
    """config.yaml as written: what may be logged (placeholders, masked secrets)."""
    return read_config(Path(run_dir) / CONFIG_FILE)


OLD_OPTIONS = {
    "optimizer": {"adamw": "torch.optim.AdamW", "sgd": "torch.optim.SGD"},
    "scheduler": {
        "constant": "runner.engines.schedules.constant",
        "cosine": "runner.engines.schedules.cosine",
    },
}


def migrate(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """`compile: true|false` as the optional section it stands for; configs of older runs:
    `tensorboard: true|false` became the logger group; optimizers and schedulers named by
    `name` became components."""
    migrated = dict(config)
    if isinstance(migrated.get("compile"), bool):
        migrated["compile"] = {} if migrated["compile"] else None
    for group, targets in OLD_OPTIONS.items():  # optimizer and scheduler by `name`
        node = migrated.get(group)
        if isinstance(node, Mapping) and node.get("name") in targets:
            node = dict(node)
            migrated[group] = {TARGET: targets[node.pop("name")], **node}
    if "tensorboard" in config and "logger" not in config:
        tensorboard = migrated.pop("tensorboard")
        migrated["logger"] = {"tensorboard": {}} if tensorboard else {}
    return migrated
