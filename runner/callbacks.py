"""Callbacks: a user's code called at points of a run, named by `_target_` in `callbacks=[...]`.

A callback is any object with some of the hook methods below (subclassing `Callback` is
optional). Each hook gets the `Run` (where, which rank, the config, the model) and one
value; it may read, log or write files of its own, and must not change the training
numbers: the weights, the optimizer, the data or the random streams the run draws from.

    on_fit_start(run)                 before the first step of this start (fresh or resumed)
    on_step_end(run, record)          each record of metrics.jsonl: not every step, but every
                                      log_interval steps, each evaluation's and the last
    on_eval_end(run, metrics)         each evaluation: {"step", "val/loss", "val/<metric>"}
    on_checkpoint_saved(run, path)    a checkpoint complete (on rank 0: sealed, the latest)
    on_fit_end(run, summary)          the run finished; summary.json's content (rank 0)

By default only rank 0 calls them (`ranks: main` in the callback's node); `ranks: all`
calls them on every rank, each with its own `run.rank`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HOOKS = ("on_fit_start", "on_step_end", "on_eval_end", "on_checkpoint_saved", "on_fit_end")

# What other tools call these points: a Lightning or Composer user's first guess.
OTHER_NAMES = {
    "on_train_start": "on_fit_start",
    "on_train_begin": "on_fit_start",
    "on_fit_begin": "on_fit_start",
    "on_train_batch_end": "on_step_end",
    "on_batch_end": "on_step_end",
    "on_validation_end": "on_eval_end",
    "on_validation_epoch_end": "on_eval_end",
    "on_evaluate": "on_eval_end",
    "on_save_checkpoint": "on_checkpoint_saved",
    "on_save": "on_checkpoint_saved",
    "on_train_end": "on_fit_end",
}


@dataclass
class Run:
    """What a hook knows of the run. `model` is the module being trained (wrapped by the
    parallelism: sharded under fsdp and zero3): read it, never change it."""

    run_dir: Path
    rank: int
    world_size: int
    config: dict[str, Any]  # the resolved config as config.yaml writes it (secrets kept out)
    model: Any = None
    step: int = 0  # the latest optimizer step taken
    state: dict[str, Any] = field(default_factory=dict)  # the callbacks' own scratch space

    @property
    def is_main(self) -> bool:
        return self.rank == 0


class Callback:
    """A base with every hook doing nothing: override the ones you need."""

    def on_fit_start(self, run: Run) -> None:
        pass

    def on_step_end(self, run: Run, record: dict[str, Any]) -> None:
        pass

    def on_eval_end(self, run: Run, metrics: dict[str, Any]) -> None:
        pass

    def on_checkpoint_saved(self, run: Run, path: Path) -> None:
        pass

    def on_fit_end(self, run: Run, summary: dict[str, Any]) -> None:
        pass


def implemented_hooks(target: type) -> list[str]:
    """The hooks a callback class defines itself (not Callback's empty ones)."""
    return [
        name
        for name in HOOKS
        if callable(getattr(target, name, None))
        and getattr(target, name) is not getattr(Callback, name, None)
    ]


def hook_problems(key: str, target: type) -> list[str]:
    """Methods named like hooks that runner never calls (a typo, another tool's name), and a
    class with no hook at all."""
    found = []
    for name in sorted(n for n in dir(target) if n.startswith("on_") and n not in HOOKS):
        if not callable(getattr(target, name)):
            continue
        close = OTHER_NAMES.get(name) or next(
            iter(difflib.get_close_matches(name, HOOKS, n=1, cutoff=0.6)), None
        )
        hint = f"did you mean {close}?" if close else f"the hooks: {', '.join(HOOKS)}"
        found.append(f"{key}: {target.__name__}.{name} is not a hook runner calls; {hint}")
    if not found and not implemented_hooks(target):
        found.append(f"{key}: {target.__name__} has none of the hooks ({', '.join(HOOKS)})")
    return found
