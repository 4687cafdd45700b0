"""hydra/sweeper=runner's search space: the sweep's overrides as Optuna distributions, read
with Hydra's public override grammar (the same meaning as Hydra's Optuna sweeper gives
them, and the same distribution classes, so a study kept by either goes on).

    optimizer.lr=interval(1e-4,1e-1)      a float, uniform; tag(log, interval(...)): log-uniform
    grad_accum=range(1,5)                  an int, uniform (with a float: a stepped float)
    parallelism=choice(ddp,zero2)          categorical (so is a comma list, and shuffle(range))
    seed=3                                 fixed: every trial runs with it
"""

from __future__ import annotations

from typing import Any


def search_space(arguments: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """(the searched keys' distributions, the fixed keys' values as typed)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    searched: dict[str, Any] = {}
    fixed: dict[str, str] = {}
    for override in OverridesParser.create().parse_overrides(arguments):
        key = override.get_key_element()
        if override.is_sweep_override():
            searched[key] = _distribution(override)
        else:
            fixed[key] = override.get_value_element_as_str()
    return searched, fixed


def _distribution(override: Any) -> Any:
    from hydra.core.override_parser.types import Transformer
    from optuna import distributions as d

    value = override.value()
    if override.is_choice_sweep() or (override.is_range_sweep() and value.shuffle):
        return d.CategoricalDistribution(list(override.sweep_iterator(Transformer.encode)))
    if override.is_range_sweep():
        if any(isinstance(x, float) for x in (value.start, value.stop, value.step)):
            return d.DiscreteUniformDistribution(value.start, value.stop, value.step)
        return d.IntUniformDistribution(int(value.start), int(value.stop), step=int(value.step))
    whole = isinstance(value.start, int) and isinstance(value.end, int)  # an interval
    if "log" in value.tags:
        if whole:
            return d.IntLogUniformDistribution(int(value.start), int(value.end))
        return d.LogUniformDistribution(value.start, value.end)
    if whole:
        return d.IntUniformDistribution(value.start, value.end)
    return d.UniformDistribution(value.start, value.end)
