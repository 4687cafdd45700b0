"""The agent's check of the user's components, before any rank starts.

The parent never imports torch or user code, so it can only check that each `_target_`
looks like a dotted path. The agent has torch loaded already (it was prestarted while
Hydra composed), so it imports every `_target_`, and binds each node's arguments to the
target's signature: unknown (with a did-you-mean), missing and duplicated arguments,
nested `_target_` nodes included. The values runner passes itself (what the data reports,
such as num_classes) count as given; the data is built to learn them only when a required
argument is otherwise missing. Problems are reported like every other invalid
configuration: all at once, exit 2, no rank started.

Before that, the data is prepared (runner.data.datasets.prepare_data: a corpus tokenized
into its cache), here where no watchdog runs yet, once per node rather than once per rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runner import components
from runner.callbacks import hook_problems
from runner.data.datasets import build_datasets, prepare_data
from runner.data.splits import Datasets
from runner.data.streams import is_iterable
from runner.errors import describe, first_line
from runner.models.blocks import find_blocks
from runner.models.builders import build_model
from runner.models.families import family_of_target
from runner.spec import RunSpec
from runner.spec.mesh import dimension_problems

log = logging.getLogger("runner")
INVALID = 2  # the exit code of an invalid configuration, as in the parent


def component_problems(spec: RunSpec) -> list[str]:
    found = components.problems("data", spec.data.node)
    if not found:
        found += _prepare_problems(spec)
    built: dict[str, Any] = {}

    def datasets() -> Datasets | None:
        """The data (built once, and only when asked); None if it cannot be built."""
        if "data" not in built:
            built["data"] = None
            if not found:
                try:
                    built["data"] = build_datasets(spec.data)
                except Exception as exc:
                    cause = (
                        exc.__cause__ if type(exc).__name__ == "InstantiationException" else None
                    )
                    exc = cause or exc
                    if isinstance(exc, ValueError):  # the component's message names the key
                        found.append(_first_line(exc))
                    else:
                        found.append(
                            f"data._target_={spec.data.target}: building the data raised "
                            + describe(exc)
                        )
        return built["data"]

    def provided() -> dict[str, Any] | None:
        """What the data reports; None if it cannot say."""
        data = datasets()
        return None if data is None else data.info

    if spec.max_steps is None or spec.scheduler.warmup_epochs is not None:
        found += _stream_problems(spec, datasets)

    found += components.problems("model", spec.model.node, provided)
    found += _optimizer_problems(spec)
    for i, callback in enumerate(spec.callbacks):
        found += _callback_problems(f"callbacks[{i}]", callback.node)
    found += components.problems("loss", spec.loss.node, provided)
    for name, metric in spec.metrics.items():
        found += components.problems(f"metrics.{name}", metric.node, provided)
    wrap = spec.parallelism.wrap
    grid = spec.grid
    split = max(grid.splits.values()) > 1
    # a family that checks its own options as it is built (on the meta device: free)
    checks_itself = family_of_target(spec.model.target).checks_itself
    if (spec.checkpoint_every or wrap or split or checks_itself) and not found:
        found += model_problems(spec, provided())
    if (spec.optimizer.lr_multipliers or spec.optimizer.no_weight_decay) and not found:
        found += _pattern_problems(spec, provided())
    if spec.init_from.path is not None and not found:
        found += _init_from_problems(spec, provided())
    return found


def _prepare_problems(spec: RunSpec) -> list[str]:
    """Prepare the data; what went wrong, as a problem (its messages name the keys)."""
    try:
        prepared = prepare_data(spec.data)
    except (ValueError, OSError) as exc:
        return [_first_line(exc)]
    except Exception as exc:
        return [f"data._target_={spec.data.target}: preparing the data raised " + describe(exc)]
    if prepared is not None:
        log.info("runner: data: %s", prepared)
    return []


def _stream_problems(spec: RunSpec, datasets: Callable[[], Datasets | None]) -> list[str]:
    """An iterable training set has no length: no epochs to count."""
    data = datasets()
    if data is None or not is_iterable(data.train):
        return []
    what = (
        f"data={spec.data.name} gives an iterable dataset ({type(data.train).__name__}, no length)"
    )
    if spec.max_steps is None:
        return [
            f"max_steps=null: {what}, so max_epochs={spec.max_epochs} cannot end the run; "
            "set max_steps"
        ]
    return [
        f"scheduler.warmup_epochs={spec.scheduler.warmup_epochs}: {what}, so an epoch has no "
        "length; use scheduler.warmup_steps"
    ]


def _first_line(exc: BaseException) -> str:
    return first_line(exc) or type(exc).__name__


def _optimizer_problems(spec: RunSpec) -> list[str]:
    """The optimizer and the schedule, bound and then built on a probe parameter: what
    they are given and what they give are checked, not only their signatures."""
    import torch

    from runner.engines.optim import make_optimizer
    from runner.engines.schedules import build_scheduler

    optimizer, scheduler = spec.optimizer, spec.scheduler
    found = components.problems("optimizer", {**optimizer.node, "_partial_": True})
    target = None if found else components.locate(optimizer.target)
    if isinstance(target, type) and not issubclass(target, torch.optim.Optimizer):
        found.append(
            f"optimizer._target_={optimizer.target}: {target.__name__} is not an optimizer "
            "(a torch.optim.Optimizer subclass, or a function returning one)"
        )
    built = None
    if not found:
        try:
            built = make_optimizer(optimizer, [{"params": [torch.nn.Parameter(torch.zeros(2))]}])
        except Exception as exc:
            found.append(_built("optimizer", optimizer.target, exc))
    bound = components.problems(
        "scheduler", scheduler.node, {"optimizer": None, "total_steps": None}
    )
    found += bound
    if built is not None and not bound:
        try:
            build_scheduler(scheduler, built, total_steps=scheduler.warmup_steps + 100)
        except Exception as exc:
            found.append(_built("scheduler", scheduler.target, exc))
    return found


def _callback_problems(key: str, node: dict[str, Any]) -> list[str]:
    """Bound like any component; a class's methods named like hooks must be hooks."""
    found = components.problems(key, node)
    target = None if found else components.locate(node[components.TARGET])
    if isinstance(target, type):
        found += hook_problems(key, target)
    return found


def _built(key: str, target: str, exc: Exception) -> str:
    """A problem line for a component that raised while it was built."""
    cause = exc.__cause__ if type(exc).__name__ == "InstantiationException" else None
    exc = cause if isinstance(cause, Exception) else exc
    if isinstance(exc, TypeError) and str(exc).startswith(f"{key}._target_="):
        return str(exc)  # runner's own: it gave something else
    return f"{key}._target_={target}: building it raised {describe(exc)}"


def _pattern_problems(spec: RunSpec, info: dict[str, Any] | None) -> list[str]:
    """Name patterns of the optimizer's keys that match no parameter of the model."""
    import torch

    from runner.engines.optim import named_parameters, unmatched_patterns

    if info is None:
        return []
    try:
        with torch.device("meta"):
            model = build_model(spec.model, info)
    except Exception:  # it reads values while it is built: the whole model, then
        model = build_model(spec.model, info)
    names = [name for name, _, _ in named_parameters(model)]
    return [
        f"{where}: matches no parameter of {type(model).__name__} (it has {_sample(names)})"
        for where in unmatched_patterns(spec.optimizer, names)
    ]


def _sample(names: list[str]) -> str:
    shown = ", ".join(names[:6])
    return shown + (f", ... ({len(names)} in all)" if len(names) > 6 else "")


def model_problems(spec: RunSpec, info: dict[str, Any] | None) -> list[str]:
    """Activation checkpointing needs blocks, tensor parallelism a plan that fits the model:
    build the model on the meta device (no memory, no init cost) and look."""
    import torch

    if info is None:
        return []
    try:
        with torch.device("meta"):
            model = build_model(spec.model, info)
    except Exception as exc:
        cause = exc.__cause__ if type(exc).__name__ == "InstantiationException" else None
        exc = cause or exc
        if isinstance(exc, ValueError) and str(exc).startswith("model."):
            return [_first_line(exc)]  # the model's own check: it names the key
        return [f"model._target_={spec.model.target}: building it raised {describe(exc)}"]
    found = []
    wrap = list(spec.parallelism.wrap)
    if wrap and not find_blocks(model, wrap):
        classes = sorted({type(m).__name__ for m in model.modules()} - {type(model).__name__})
        found.append(
            f"parallelism.wrap={wrap}: {type(model).__name__} has no module of that class; "
            f"it has {', '.join(classes)}"
        )
    found += dimension_problems(model, spec)
    if spec.checkpoint_every and not find_blocks(model):
        found.append(
            f"activation_checkpointing={spec.activation_checkpointing}: {type(model).__name__} "
            "has no blocks (a ModuleList of modules of one class) to checkpoint; valid here: none"
        )
    return found


def _init_from_problems(spec: RunSpec, info: dict[str, Any] | None) -> list[str]:
    """The pretrained weights' file: readable, and its names and shapes those of the model
    (built on the meta device: shapes only)."""
    import torch

    from runner.models.checkpoint_weights import weights_file
    from runner.models.pretrained import loaded_tensors, match
    from runner.models.tensor_files import WeightsFileError

    path = spec.init_from.path
    if info is None:
        return []
    try:
        with weights_file(Path(path)) as file:
            try:
                with torch.device("meta"):
                    model = build_model(spec.model, info)
            except Exception:  # it reads values while it is built: the whole model, then
                model = build_model(spec.model, info)
            matching = match(file, loaded_tensors(model), spec.init_from, model)
    except WeightsFileError as exc:
        return [f"init_from.path={path}: {exc}"]
    found = matching.problems(spec.init_from)
    if not found:
        log.info("runner: init_from: %s (%s)", path, matching.summary())
    return found
