"""`Datasets`: what a data component returns, in the one shape the trainer reads.

A data component (`data._target_`) may return a `Datasets`, a mapping with `train`, `val`
and optionally `collate_fn` plus whatever the model needs to know (`num_classes`,
`input_shape`, `vocab_size`, ...), or a `(train, val)` pair. Its own module, so builders and
the dispatch in runner.data.datasets never import each other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Datasets:
    """Map-style train and validation datasets, and what the model needs to know of them.

    `info` values reach the arguments of the model, loss and metrics that are named alike
    (`num_classes`, `vocab_size`, ...) unless the config sets them.
    """

    train: Any
    val: Any = None
    collate_fn: Callable[[list[Any]], Any] | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, result: Any, source: str) -> Datasets:
        """Normalise what a data component returned; `source` names it in errors."""
        if isinstance(result, Datasets):
            return result
        if isinstance(result, Mapping) and "train" in result:
            rest = dict(result)
            train, val = rest.pop("train"), rest.pop("val", None)
            return cls(train, val, rest.pop("collate_fn", None), rest)
        if isinstance(result, (tuple, list)) and len(result) == 2:
            return cls(result[0], result[1])
        raise TypeError(
            f"{source} returned {type(result).__name__}; expected a mapping with `train` and "
            "`val` datasets (optionally `collate_fn`, `num_classes`, ...), a (train, val) pair, "
            "or runner.data.Datasets"
        )
