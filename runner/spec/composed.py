"""A composed Hydra config as a checked RunSpec, and its problems as the user reads them:
shared by a run (runner.cli.main) and `runner prepare` (runner.cli.prepare)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner.errors import first_line
from runner.secrets import Secrets, masked_problems
from runner.spec import RunSpec, SpecError, resolve_spec


def resolve_cfg(cfg: DictConfig, run_dir: Path, requeued: bool = False) -> tuple[RunSpec, Secrets]:
    """The checked spec, and what of it must not be written as resolved."""
    try:
        data = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "config"
        raise SpecError([f"{key}: {first_line(exc)}"]) from None
    masked = masked_problems(data)
    if masked:
        raise SpecError(masked)
    if requeued and isinstance(data, dict) and data.get("resume") is None:
        data["resume"] = "auto"  # SLURM started the job again: go on from its checkpoint
    secrets = Secrets.of(OmegaConf.to_container(cfg, resolve=False), data)
    return resolve_spec(data, run_dir=run_dir), secrets  # type: ignore[arg-type]


def problems_text(problems: list[str]) -> str:
    count = len(problems)
    lines = "\n".join(f"  - {p}" for p in problems)
    return f"runner: invalid configuration ({count} problem{'s' * (count > 1)}):\n{lines}"
