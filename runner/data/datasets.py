"""Build the train and validation datasets the `data` component names."""

from __future__ import annotations

from runner.components import instantiate
from runner.data.types import Datasets
from runner.spec.schema import DataSpec


def build_datasets(spec: DataSpec) -> Datasets:
    return Datasets.of(instantiate(spec.node), f"data._target_={spec.target}")
