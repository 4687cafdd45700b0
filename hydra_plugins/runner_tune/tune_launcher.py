"""hydra/launcher=tune: a sweep's jobs as Ray Tune trials on a Ray cluster, each with the
resources of its ranks, scheduled first in, first out or by ASHA on `sweep.metric`
(runner.sweeps.tune_sweep holds the logic; runner.sweeps.tune_trial the trial)."""

# No `from __future__ import annotations`: Hydra runs this module without a sys.modules
# entry, where dataclasses cannot read annotations kept as strings.
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.utils import JobReturn
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig

from runner.sweeps.launched import LauncherTraits


@dataclass
class TuneLauncherConf:
    _target_: str = "hydra_plugins.runner_tune.tune_launcher.TuneLauncher"
    address: Any = None  # the Ray cluster: null = RAY_ADDRESS, else a local cluster
    gpus: Any = None  # a local cluster's GPUs: null = detected (declared: tests, CPU hosts)
    cpus_per_trial: Any = None  # null: one per rank
    gpus_per_trial: Any = None  # null: one per rank where the cluster has GPUs, else none
    max_concurrent_trials: Any = None  # null: as many as the cluster holds
    scheduler: Any = None  # null: first in, first out; asha: stop trials that fall behind
    grace_period: Any = None  # steps before ASHA may stop a trial; null: the first evaluation
    reduction_factor: int = 4  # ASHA keeps 1 in reduction_factor trials at each rung
    max_t: Any = None  # ASHA's last rung, in steps; null: the longest job's max_steps
    fail_fast: bool = False  # the first failed job stops the sweep
    rerun_failed: bool = False  # a resumed sweep runs its failed jobs again


ConfigStore.instance().store(
    group="hydra/launcher", name="tune", node=TuneLauncherConf, provider="runner"
)


class TuneLauncher(Launcher):
    # hydra/sweeper=runner: its jobs report to their Tune trial, not to the sweep's study
    sweep_traits = LauncherTraits(
        reports_elsewhere="the jobs of hydra/launcher=tune report to their Tune trial; prune "
        "with hydra.launcher.scheduler=asha"
    )

    def __init__(self, **settings: Any) -> None:
        super().__init__()
        for key, value in {**vars(TuneLauncherConf()), **settings}.items():
            if key != "_target_":
                setattr(self, key, value)
        self.stopped = False  # a signal or fail_fast stopped the sweep
        self.config: DictConfig | None = None
        self.task_function: TaskFunction | None = None
        self.hydra_context: HydraContext | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        from runner.sweeps.tune_sweep import launch

        return launch(self, job_overrides, initial_job_idx)
