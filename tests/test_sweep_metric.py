"""What a sweep compares runs by (sweep.metric, sweep.direction): chosen from the run's
metrics, returned to the sweeper, headlined by sweep tables and runner-report."""

from __future__ import annotations

from omegaconf import OmegaConf

from runner.spec import resolve_spec
from runner.sweeps.job_dirs import metric_columns
from runner.sweeps.tables import sweeper_problem
from tests.helpers.config import compose_config


def _sweep(*overrides: str):
    return resolve_spec(compose_config(list(overrides))).sweep


def test_the_metric_follows_the_runs_metrics_and_its_direction_the_metric() -> None:
    classification = _sweep()
    assert (classification.metric, classification.direction) == ("val/accuracy", "maximize")
    language = _sweep("+recipe=gpt_text")
    assert (language.metric, language.direction) == ("val/loss", "minimize")
    perplexity = _sweep("+recipe=gpt_text", "sweep.metric=val/perplexity")
    assert perplexity.direction == "minimize"
    told = _sweep("sweep.metric=train/loss", "sweep.direction=maximize")
    assert (told.metric, told.direction) == ("train/loss", "maximize")


def test_optunas_direction_must_agree() -> None:
    spec = resolve_spec(compose_config([]))
    optuna = "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    against = OmegaConf.create({"_target_": optuna, "direction": "minimize"})
    assert sweeper_problem(against, spec) == (
        "hydra.sweeper.direction=minimize: each job returns its final val/accuracy "
        "(sweep.metric), which is to maximize (sweep.direction); set "
        "hydra.sweeper.direction=maximize, or sweep.direction to say otherwise"
    )
    assert (
        sweeper_problem(OmegaConf.create({"_target_": optuna, "direction": "MAXIMIZE"}), spec)
        is None
    )
    several = OmegaConf.create({"_target_": optuna, "direction": ["minimize", "maximize"]})
    assert sweeper_problem(several, spec) is None
    basic = OmegaConf.create(
        {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"}
    )
    assert sweeper_problem(basic, spec) is None


def test_tables_put_each_runs_metric_first() -> None:
    assert metric_columns([{"sweep.metric": "val/loss"}]) == ["val/loss", "train/loss"]
    assert metric_columns([{"sweep.metric": "val/accuracy"}, {}]) == [
        "val/accuracy",
        "val/loss",
        "train/loss",
    ]
    assert metric_columns([{"sweep.metric": "auto"}]) == ["val/accuracy", "val/loss", "train/loss"]
