"""hydra/launcher=runner: run a sweep's jobs side by side on this node, each on its own
devices (a slot: runner.sweeps.slots) and in its own process tree.

Hydra finds launchers here; the sweep itself is runner.sweeps.side_by_side (the slots the
jobs start in as they free up, resuming a sweep, failures and fail_fast) and each job's
forked process runner.sweeps.job_process.
"""

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
class RunnerLauncherConf:
    _target_: str = "hydra_plugins.runner_launcher.runner_launcher.RunnerLauncher"
    devices: Any = None  # GPU ids; null: every visible GPU, else the cores
    fail_fast: bool = False  # the first failed job stops the sweep
    rerun_failed: bool = False  # a resumed sweep runs its failed jobs again


ConfigStore.instance().store(
    group="hydra/launcher", name="runner", node=RunnerLauncherConf, provider="runner"
)


class RunnerLauncher(Launcher):
    # hydra/sweeper=runner: an interrupted trial goes on from its checkpoint; its jobs run
    # on this host, where the study hears their reports
    sweep_traits = LauncherTraits(goes_on_with_trials=True)

    def __init__(
        self, devices: Any = None, fail_fast: bool = False, rerun_failed: bool = False
    ) -> None:
        from runner.sweeps.progress import SweepProgress

        super().__init__()
        self.devices = devices  # checked as the sweep starts (runner.sweeps.slots.device_problems)
        self.fail_fast = bool(fail_fast)
        self.rerun_failed = bool(rerun_failed)
        self.stopped = False  # a signal or fail_fast stopped the sweep: no job starts any more
        # where the sweep stands, over every launch (a sweeper's)
        self.progress = SweepProgress(queued=0)
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
        from runner.sweeps.side_by_side import launch

        return launch(self, job_overrides, initial_job_idx)
