"""hydra/sweeper=runner: Optuna's search over a run's config, with what a long sweep needs.

- The study lives in the sweep directory (`optuna.db`, SQLite; `hydra.sweeper.storage`
  names another), so the same command run again there goes on with it: trials that ended
  stay as they ended, the ones the stop interrupted go on from their last checkpoint under
  their own numbers (with hydra/launcher=runner), and only the missing trials are asked.
- The direction is the run's `sweep.direction` unless `hydra.sweeper.direction` says it.
- A pruner (`hydra/sweeper/pruner=median|hyperband|asha`) stops trials that fall behind:
  rank 0 of each job reports `sweep.metric` at every evaluation (runner.train.pruning) and
  the job ends there with a checkpoint, status `pruned`.
- Job N is trial N, so a job's directory, its row in sweep.md and its trial in the study
  agree.
"""

# No `from __future__ import annotations`: Hydra runs this module without a sys.modules
# entry, where dataclasses cannot read annotations kept as strings.
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import MISSING, DictConfig, OmegaConf

log = logging.getLogger(__name__)


@dataclass
class RunnerSweeperConf:
    _target_: str = "hydra_plugins.runner_sweeper.runner_sweeper.RunnerSweeper"
    defaults: list[Any] = field(
        default_factory=lambda: ["_self_", {"sampler": "tpe"}, {"pruner": None}]
    )
    sampler: Any = MISSING  # hydra/sweeper/sampler=tpe|random|cmaes|grid|... (Optuna's)
    pruner: Any = None  # hydra/sweeper/pruner=median|hyperband|asha; null: no pruning
    direction: str | None = None  # null: the run's sweep.direction
    storage: str | None = None  # null: SQLite in the sweep directory (optuna.db)
    study_name: str = "sweep"
    n_trials: int = 20
    n_jobs: int = 2  # trials asked at once, run side by side (as the launcher allows)
    params: dict[str, str] | None = None


@dataclass
class MedianPrunerConf:  # a trial worse than the median of the others at the same step
    name: str = "median"
    n_startup_trials: int = 5  # trials that end before any is pruned
    n_warmup_steps: int = 0  # steps of a trial before it can be pruned
    interval_steps: int = 1


@dataclass
class HyperbandPrunerConf:
    name: str = "hyperband"
    min_resource: int = 1  # steps
    max_resource: Any = "auto"  # steps; auto: the first trial that ends
    reduction_factor: int = 3


@dataclass
class AshaPrunerConf:  # asynchronous successive halving
    name: str = "asha"
    min_resource: Any = "auto"  # steps
    reduction_factor: int = 4
    min_early_stopping_rate: int = 0


store = ConfigStore.instance()
store.store(group="hydra/sweeper", name="runner", node=RunnerSweeperConf, provider="runner")
for _name, _node in (
    ("median", MedianPrunerConf),
    ("hyperband", HyperbandPrunerConf),
    ("asha", AshaPrunerConf),
):
    store.store(group="hydra/sweeper/pruner", name=_name, node=_node, provider="runner")


class RunnerSweeper(Sweeper):
    def __init__(
        self,
        sampler: Any,
        pruner: Any,
        direction: str | None,
        storage: str | None,
        study_name: str,
        n_trials: int,
        n_jobs: int,
        params: DictConfig | None,
    ) -> None:
        self.sampler = sampler
        self.pruner = None if pruner is None else OmegaConf.to_container(pruner)
        self.direction = direction
        self.storage = storage
        self.study_name = study_name
        self.n_trials = n_trials
        self.n_jobs = n_jobs
        self.params = params
        self.config: DictConfig | None = None
        self.launcher: Any = None
        self.hydra_context: HydraContext | None = None

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        from hydra.core.plugins import Plugins

        self.config = config
        self.hydra_context = hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )

    def sweep(self, arguments: list[str]) -> None:
        from runner.sweeps.study_sweep import StudySweep

        assert self.config is not None and self.hydra_context is not None
        params = [f"{k!s}={v}" for k, v in (self.params or {}).items()]
        StudySweep(self, Path(str(self.config.hydra.sweep.dir))).run([*params, *arguments])
