"""The plan of a parallelism=auto run: every candidate layout checked by the spec's own
checks, its memory and step time predicted, and the fastest that fits chosen.

The parent (`runner plan`, or a run with parallelism=auto) never imports torch: it runs
`python -m runner.layouts.planner` with the composed config (resolved, as JSON) on stdin
and reads the plan, as JSON, from its stdout. This process measures the model once
(runner.layouts.model_facts), lists the candidates (runner.layouts.candidates), gives each
the config keys a user would have given, and resolves it as a run would be: a candidate the
spec's checks or the agent's model checks refuse is listed with their words.
"""

from __future__ import annotations

import copy
import json
import logging
import sys
from functools import partial
from pathlib import Path
from typing import Any

from runner.hardware import cpu_cores
from runner.layouts.candidates import Candidate, candidates
from runner.layouts.forked import forked_map
from runner.layouts.memory import Ranks, peak_bytes, state_bytes
from runner.layouts.speed import step_seconds
from runner.spec import RunSpec, SpecError, resolve_spec
from runner.spec.mesh import SPLITS
from runner.spec.plan_specs import FIXABLE, MORE, NoneFits, group_option, parse_size, shortfall

log = logging.getLogger("runner")
STAND_IN = "ddp"  # the layout the model is measured under: any will do


def with_layout(config: dict[str, Any], candidate: Candidate, conf_dir: Path) -> dict[str, Any]:
    """`config` with `candidate`'s keys given, over its engine's defaults."""
    config = copy.deepcopy(config)
    options = group_option(conf_dir, "parallelism", candidate.engine)
    for key, value in candidate.overrides().items():
        if key.startswith("parallelism."):
            options[key.split(".", 1)[1]] = value
    config["parallelism"] = options
    config["activation_checkpointing"] = candidate.checkpointing
    config["grad_accum"] = candidate.grad_accum
    return config


def make_plan(
    config: dict[str, Any],
    conf_dir: Path,
    run_dir: Path | None,
    fixed: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The plan of `config` (its parallelism `auto`); `fixed`: the layout keys the user gave
    (grad_accum=4): only the candidates that keep them are weighed. Raises SpecError for a
    config that no layout could make valid (a problem of its own), or when no valid layout
    fits."""
    from runner.layouts.model_facts import measure

    stand_in = _stand_in(config, fixed or {}, conf_dir, run_dir)
    try:
        facts = measure(stand_in, stand_in.nproc, stand_in.device, _data(stand_in)).as_dict()
    except Exception:  # a component the run's own checks refuse: refused with their words
        _check_components(stand_in)
        raise
    listed = candidates(
        nproc=stand_in.nproc, nodes=stand_in.nodes, global_batch=stand_in.global_batch_size,
        blocks=len(facts["blocks"]), heads=facts["heads"], sequence=facts["sequence"],
        splits=facts["splits"], experts=facts["experts"]["count"],
    )  # fmt: skip
    try:
        listed = _keeping(listed, fixed or {})
    except SpecError as err:  # with what the checks say of that layout given by hand
        why = _by_hand(config, fixed or {}, conf_dir, run_dir, facts)
        raise SpecError([f"{err.problems[0]}{why}"]) from None
    budget, budget_from = _budget(stand_in, facts)
    # each candidate's resolution and checks, side by side where no CUDA context is open
    workers = cpu_cores() if facts["traced_on"] == "cpu" else 1
    weigh = partial(_weigh, config, conf_dir=conf_dir, run_dir=run_dir, facts=facts, budget=budget)
    rows = forked_map(weigh, listed, workers)
    fitting = [r for r in rows if r["valid"] and r["fits"]]
    plan = {
        "world_size": stand_in.world_size,
        "device": facts["device"],
        "budget_bytes": budget,
        "budget": budget_from,
        "model": {
            "parameters": sum(facts["params"]),
            "blocks": len(facts["blocks"]),
            "traced_on": facts["traced_on"],
        },
        "fixed": fixed or {},
        "candidates": rows,
        "chosen": None,
    }
    if not fitting:
        raise NoneFits([_none_fits(rows, budget, budget_from)], plan)
    best = min(fitting, key=lambda r: (round(r["predicted"]["step_s"], 6), _simpler(r)))
    plan["chosen"] = best["name"]
    return plan


SIMPLER = ("ddp", "zero1", "zero2", "fsdp", "zero3")


def _simpler(row: dict[str, Any]) -> tuple[int, int, int]:
    """Between candidates predicted alike: the engine with fewer moving parts, fewer model
    splits, the larger microbatch."""
    overrides = row["overrides"]
    engine = overrides.get("parallelism", "ddp")
    splits = sum(
        int(overrides.get(f"parallelism.{k}", 1) or 1) > 1 for k in (d.name for d in SPLITS)
    )
    return (
        SIMPLER.index(engine) if engine in SIMPLER else len(SIMPLER),
        splits,
        int(overrides.get("grad_accum", 1)),
    )


def _keeping(listed: list[Candidate], fixed: dict[str, Any]) -> list[Candidate]:
    """The candidates that keep every fixed key; none: a problem naming the keys."""

    def keeps(candidate: Candidate) -> bool:
        values = {key: getattr(candidate, FIXABLE[key]) for key in fixed}
        return all(str(values[key]).lower() == str(given).lower() for key, given in fixed.items())

    kept = [c for c in listed if keeps(c)]
    if fixed and not kept:
        given = " ".join(f"{k}={v}" for k, v in fixed.items())
        raise SpecError([f"parallelism=auto: no layout it weighs keeps {given}; leave it out"])
    return kept


def _stand_in(
    config: dict[str, Any], fixed: dict[str, Any], conf_dir: Path, run_dir: Path | None
) -> RunSpec:
    """`config` resolved under the layout the model is measured with; SpecError for what no
    layout could make valid: a problem of its own, a fixed key not of its type, trials
    across nodes."""
    stand_in = _resolve(with_layout(config, Candidate(STAND_IN), conf_dir), run_dir)
    problems = stand_in if isinstance(stand_in, list) else []
    problems = problems or _untyped(config, fixed, conf_dir, run_dir)
    if problems:
        raise SpecError(problems)
    if stand_in.plan.trials and stand_in.nodes > 1:
        raise SpecError([
            f"plan.trials={stand_in.plan.trials}: trials run on one node (nodes="
            f"{stand_in.nodes}); plan there with nproc, or set plan.trials=0"
        ])  # fmt: skip
    return stand_in


def _untyped(
    config: dict[str, Any], fixed: dict[str, Any], conf_dir: Path, run_dir: Path | None
) -> list[str]:
    """A fixed key whose value is not of its type (parallelism.expert=abc) or a degree below
    1, in the words a run given it by hand refuses it with; none: []."""
    wrong = {k: v for k, v in fixed.items() if k != "activation_checkpointing" and not _fits(k, v)}
    if not wrong:
        return []
    config = with_layout(config, Candidate("fsdp"), conf_dir)
    for key, value in wrong.items():
        place, name = key.split(".", 1) if "." in key else (None, key)
        (config[place] if place else config)[name] = value
    problems = _resolve(config, run_dir)
    named = (
        [p for p in problems if any(k in p for k in wrong)] if isinstance(problems, list) else []
    )
    return named or [f"{k}={v!r}: expected an integer" for k, v in wrong.items()]


def _fits(key: str, value: Any) -> bool:
    """Whether `value` is a whole number, and a degree (parallelism.*) at least 1."""
    try:
        whole = int(value) == value or str(int(value)) == str(value).strip()
    except (TypeError, ValueError):
        return False
    return whole and (int(value) >= 1 or not key.startswith("parallelism."))


def _by_hand(
    config: dict[str, Any],
    fixed: dict[str, Any],
    conf_dir: Path,
    run_dir: Path | None,
    facts: dict[str, Any],
) -> str:
    """Why fsdp with the `fixed` keys, given by hand, would be refused (`: ...`), or "" (their
    types were checked: _untyped)."""
    keys = {FIXABLE[key]: value for key, value in fixed.items()}
    keys = {k: v if k == "checkpointing" else int(v) for k, v in keys.items()}
    candidate = Candidate("fsdp", **keys)
    spec = _resolve(with_layout(config, candidate, conf_dir), run_dir)
    problems = spec if isinstance(spec, list) else _model_problems(spec, facts)
    return f" (given by hand: {problems[0]})" if problems else ""


def _resolve(config: dict[str, Any], run_dir: Path | None) -> RunSpec | list[str]:
    try:
        return resolve_spec(config, run_dir=run_dir)
    except SpecError as err:
        return err.problems


def _budget(spec: RunSpec, facts: dict[str, Any]) -> tuple[int, str]:
    """The bytes a rank may fill, and where that number comes from."""
    given = spec.plan.memory_per_rank
    if given is not None:
        return int(parse_size(given) or 0), f"plan.memory_per_rank={given}"
    memory = facts["device"]["memory"]
    fraction = spec.plan.memory_fraction
    where = "a GPU's memory" if facts["device"]["kind"] == "cuda" else "RAM over the ranks"
    return int(memory * fraction), f"plan.memory_fraction={fraction:g} of {where}"


def _weigh(
    config: dict[str, Any],
    candidate: Candidate,
    *,
    conf_dir: Path,
    run_dir: Path | None,
    facts: dict[str, Any],
    budget: int,
) -> dict[str, Any]:
    """One row of the plan: the candidate's keys, the checks' verdict, its prediction."""
    row: dict[str, Any] = {"name": candidate.name, "overrides": candidate.overrides()}
    spec = _resolve(with_layout(config, candidate, conf_dir), run_dir)
    problems = spec if isinstance(spec, list) else _model_problems(spec, facts)
    why = facts.get("untraceable", {}).get(candidate.checkpointing)
    if why and not problems:  # the ranks would fail as the trace did
        problems = [f"activation_checkpointing={candidate.checkpointing}: tracing it raised {why}"]
    row["valid"] = not problems
    if problems:
        return {**row, "problems": problems, "fits": False}
    assert isinstance(spec, RunSpec)
    ranks = Ranks(
        world=spec.world_size, global_batch=spec.global_batch_size,
        options=group_option(conf_dir, "parallelism", candidate.engine), device=spec.device,
        precision=spec.precision.name.value, nodes=spec.nodes,
    )  # fmt: skip
    memory = peak_bytes(facts, candidate, ranks)
    speed = step_seconds(facts, candidate, ranks)
    row["predicted"] = {
        "state_bytes": state_bytes(facts, candidate, ranks)["total"],
        "peak_bytes": memory["peak"],
        "step_s": speed["step_s"],
    }
    row["parts"] = {"memory": memory, "time": speed}
    row["fits"] = memory["peak"] <= budget
    return row


def _check_components(spec: RunSpec) -> None:
    """The checks a run's agent makes of the data, the model and the rest before any rank
    starts (an argument the component does not take, ...): a config they refuse is refused
    here with their words, not as the trace's error."""
    from runner.launch.preflight import component_problems

    problems = component_problems(spec)
    if problems:
        raise SpecError(problems)


_MODEL_CHECKS: dict[tuple[int, ...], list[str]] = {}


def _model_problems(spec: RunSpec, facts: dict[str, Any]) -> list[str]:
    """The agent's checks of the model against the layout (blocks to checkpoint, a tensor
    plan that fits, stages that divide the layers), as a run's preflight makes them: once
    per mesh."""
    from runner.launch.preflight import model_problems

    grid = spec.grid
    key = (*grid.splits.values(), spec.checkpoint_every, grid.replicate)
    if key not in _MODEL_CHECKS:
        if max(grid.splits.values()) == 1 and not spec.checkpoint_every:
            _MODEL_CHECKS[key] = []
        else:
            _MODEL_CHECKS[key] = model_problems(spec, _data_info(spec))
    return _MODEL_CHECKS[key]


_DATA: dict[str, Any] = {}


def _data(spec: RunSpec) -> Any:
    """The run's datasets: built once a plan (every candidate reads the same data), before
    the model is measured and its candidates are resolved side by side."""
    key = repr(spec.data)
    if key not in _DATA:
        from runner.data.datasets import build_datasets

        _DATA[key] = build_datasets(spec.data)
    return _DATA[key]


def _data_info(spec: RunSpec) -> dict[str, Any]:
    """What the data tells the model (vocabulary, classes, ...)."""
    return _data(spec).info


def _none_fits(rows: list[dict[str, Any]], budget: int, budget_from: str) -> str:
    valid = [r for r in rows if r["valid"]]
    if not valid:
        reasons = sorted({p for r in rows for p in r.get("problems", [])})
        return "parallelism=auto: no layout is valid: " + "; ".join(reasons[:5])
    smallest = min(valid, key=lambda r: r["predicted"]["peak_bytes"])
    need = smallest["predicted"]["peak_bytes"]
    return shortfall("fits", budget, budget_from, smallest["name"], need, MORE)


def _warm() -> None:
    """What every plan needs first: torch, the model's measurement, a fake tensor mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import runner.layouts.model_facts  # noqa: F401

    FakeTensorMode()


def main() -> None:
    """stdin: {"config": ..., "conf_dir": ..., "run_dir": ..., "fixed": ...}; stdout: the
    plan, or {"problems": [...]}."""
    import os
    import signal
    import warnings

    from runner.processes import die_with_parent

    warnings.simplefilter("ignore")  # a fork of the warm server read no PYTHONWARNINGS

    parent = os.environ.get("RUNNER_PARENT_PID")
    die_with_parent(signal.SIGTERM, int(parent) if parent else None)
    _warm()  # while the parent composes the config
    text = sys.stdin.read()
    if not text.strip():  # the parent never asked (it stopped before the plan)
        return
    request = json.loads(text)
    run_dir = Path(request["run_dir"]) if request.get("run_dir") else None
    try:
        plan = make_plan(
            request["config"], Path(request["conf_dir"]), run_dir, request.get("fixed")
        )
    except SpecError as err:
        plan = {"problems": err.problems, "plan": getattr(err, "plan", None)}
    json.dump(plan, sys.stdout)
    sys.stdout.flush()
    # leave at once (tearing down torch's and the traced models' objects took ~2 s)
    os._exit(0)


if __name__ == "__main__":
    main()
