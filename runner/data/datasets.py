"""Build the train and validation datasets the `data` component names, and prepare them.

A data component may carry a `prepare` attribute: a callable taking the same arguments
that does the slow, cacheable part once (tokenizing a corpus into its token cache, say),
like Lightning's `prepare_data`. The launcher calls it on every node before any rank
starts, with no watchdog running, and `runner prepare` calls it alone.
"""

from __future__ import annotations

from typing import Any

from runner.components import instantiate, locate
from runner.data.splits import Datasets
from runner.spec.schema import DataSpec


def build_datasets(spec: DataSpec) -> Datasets:
    return Datasets.of(instantiate(spec.node), f"data._target_={spec.target}")


def preparer(spec: DataSpec) -> Any | None:
    """The data component's `prepare`, if it has one."""
    return getattr(locate(spec.target), "prepare", None)


def prepare_data(spec: DataSpec, **extra: Any) -> Any | None:
    """Run the data component's `prepare` with the data's arguments (nested `_target_` nodes
    built) and `extra`; None when it has none."""
    prepare = preparer(spec)
    if prepare is None:
        return None
    bound = instantiate({**spec.node, "_partial_": True})  # the arguments, built; no call
    return prepare(*bound.args, **bound.keywords, **extra)
