"""Hydra's record of a run (`.hydra/`), written by runner once it has accepted the run.

Hydra's launchers write `.hydra/{config,hydra,overrides}.yaml` into the job's directory
before they call the task function, so a run that runner then refused (a finished run's
directory, a sweep's job run again with other overrides) had lost its own record already.
runner's config sets `hydra.output_subdir: null`, and the run writes the same three files
here, after its checks: nothing is written into a directory whose run is refused.

Whether a directory holds a run already is runner.rundir.files.holds_a_run; what a sweep's
job does with an earlier start of it, runner.sweeps.resume.earlier_job.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from runner.rundir.files import HYDRA_DIR, write_atomic


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
