"""A sweep's job directories as the sweep's code reads them: which there are, in job order,
the overrides each ran (its `.hydra/overrides.yaml`), those overrides as typed, each run's
resolved config and the final values to show (sweep tables, runner-report)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

from runner.spec.convert import flatten


def job_dirs(sweep_dir: Path) -> list[Path]:
    """The sweep's job directories, in job order."""
    jobs = [p for p in sweep_dir.iterdir() if (p / ".hydra" / "overrides.yaml").is_file()]
    return sorted(jobs, key=job_order)


_PYTHON_WORDS = {"True": "true", "False": "false", "None": "null"}


def shown(overrides: list[str]) -> str:
    """Overrides as the user typed them: Hydra's sweepers write a parsed value back in
    Python's words (`progress_bar=False`); the command line, and YAML, say `false`."""
    out = []
    for override in overrides:
        key, equals, value = override.partition("=")
        out.append(
            f"{key}={_PYTHON_WORDS[value]}" if equals and value in _PYTHON_WORDS else override
        )
    return " ".join(out)


def overrides_of(job_dir: Path) -> list[str]:
    try:
        return list(yaml.safe_load((job_dir / ".hydra" / "overrides.yaml").read_text()) or [])
    except (OSError, yaml.YAMLError):
        return []


def job_order(path: Path) -> tuple[int, int, str]:
    """Sweep jobs by number (0, 1, ..., 10), other names after them alphabetically."""
    return (0, int(path.name), "") if path.name.isdigit() else (1, 0, path.name)


METRICS = ("val/accuracy", "val/loss", "train/loss")  # runs from before sweep.metric


def metric_columns(configs: list[dict[str, Any]]) -> list[str]:
    """The final values to show: each run's sweep.metric first (what the sweep compares),
    then val/loss and train/loss."""
    chosen = [c.get("sweep.metric") for c in configs]
    headline = [str(m) for m in chosen if m and m != "auto"] or [METRICS[0]]  # auto: unresolved
    return list(dict.fromkeys([*headline, "val/loss", "train/loss"]))


def run_config(run: Path) -> dict[str, Any]:
    """The run's resolved config, flattened to dotted keys (a rejected sweep job has only
    Hydra's composed config)."""
    from runner.spec.config_file import ConfigDamaged, read_config

    for candidate in (run / "config.yaml", run / ".hydra" / "config.yaml"):
        if candidate.is_file():
            try:
                return flatten(read_config(candidate))
            except (ConfigDamaged, OSError) as exc:
                print(f"runner-report: {exc}; its settings are left out", file=sys.stderr)
                return {}
    return {}
