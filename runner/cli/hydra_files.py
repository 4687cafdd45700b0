"""Hydra's record of a run (`.hydra/`), written by runner once it has accepted the run.

Hydra's launchers write `.hydra/{config,hydra,overrides}.yaml` into the job's directory
before they call the task function, so a run that runner then refused (a finished run's
directory, a sweep's job run again with other overrides) had lost its own record already.
runner's config sets `hydra.output_subdir: null`, and the run writes the same three files
here, after its checks: nothing is written into a directory whose run is refused.

A sweep's job whose directory holds an earlier start of it (the same overrides) is finished,
whatever the launcher: kept as it ended, or continued from its checkpoint
(runner.cli.sweep_resume); a directory holding another job is left as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner.cli.sweep_jobs import overrides_of
from runner.cli.sweep_resume import NEW, EarlierStart, earlier_start
from runner.rundir.files import write_atomic

HYDRA_DIR = ".hydra"


def hydra_subdir(node_rank: int) -> str:
    """`.hydra` on node 0, `node{i}/.hydra` on node i: nodes sharing a run directory never
    write each other's Hydra files."""
    return f"node{node_rank}/{HYDRA_DIR}" if node_rank > 0 else HYDRA_DIR


def write_hydra_files(task_cfg: DictConfig, run_dir: Path, node_rank: int = 0) -> None:
    """What Hydra's run_job would have written: the composed config (unresolved), Hydra's own
    node, and the job's overrides."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.instance().cfg
    assert hydra_cfg is not None
    out = run_dir / hydra_subdir(node_rank)
    write_atomic(out / "config.yaml", OmegaConf.to_yaml(task_cfg))
    write_atomic(out / "hydra.yaml", OmegaConf.to_yaml(hydra_cfg))
    write_atomic(out / "overrides.yaml", OmegaConf.to_yaml(hydra_cfg.hydra.overrides.task))


def holds_a_run(run_dir: Path) -> bool:
    """Whether a directory holds a run (or the start of one) of its own."""
    return any(
        (run_dir / name).exists()
        for name in ("summary.json", "config.yaml", "checkpoints", HYDRA_DIR)
    )


@dataclass(frozen=True)
class EarlierJob:
    """What a sweep's job directory says before the job writes anything: a problem (it holds
    another job), or how this job's earlier start ended."""

    problem: str | None
    start: EarlierStart


def earlier_job(job_dir: Path, overrides: list[str], resume: Any) -> EarlierJob:
    """How a job of a sweep goes on in `job_dir`: NEW where nothing ran; the earlier start's
    action where the same overrides ran (a failed job is kept, unless its launcher asked for
    it again with resume=auto); a problem where other overrides did."""
    if not holds_a_run(job_dir):
        return EarlierJob(None, EarlierStart(NEW))
    there = overrides_of(job_dir)
    if there != overrides:
        only_there = [o for o in there if o not in overrides]
        only_here = [o for o in overrides if o not in there]
        problem = (
            f"{job_dir} holds another job (there only: {' '.join(only_there) or '-'}; here "
            f"only: {' '.join(only_here) or '-'}); it is left as it is: resume a sweep with "
            "its own command, or pick another hydra.sweep.dir"
        )
        return EarlierJob(problem, EarlierStart(NEW))
    return EarlierJob(None, earlier_start(job_dir, rerun_failed=resume == "auto"))
