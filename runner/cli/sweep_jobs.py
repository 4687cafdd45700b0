"""A sweep's job directories as the sweep's code reads them: which there are, in job order,
the overrides each ran (its `.hydra/overrides.yaml`), and those overrides as typed."""

from __future__ import annotations

from pathlib import Path

import yaml

from runner.cli.report import job_order


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
