"""parallelism=auto in the parent: the plan (made in a child process that may import torch,
runner.layouts.planner), its table, plan.json, and the chosen layout's keys put into the
config as if the user had given them. `runner plan [overrides]` prints the plan and stops.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from runner.cli import planner_process
from runner.cli.closed_pipe import reader_left
from runner.cli.compose_errors import with_origins
from runner.errors import first_line
from runner.spec import SpecError
from runner.spec.plan_specs import NoneFits, group_option

log = logging.getLogger("runner")
AUTO = "auto"
PLAN_FILE = "plan.json"
SHOWN = 12  # rows of the table: the fastest valid layouts
LISTED = "(runner plan ... --json lists every one)"  # runner plan writes no plan.json


def wants_plan(cfg: DictConfig) -> bool:
    return str(OmegaConf.select(cfg, "parallelism.name", default="")) == AUTO


def make_plan(cfg: DictConfig, conf_dir: str, run_dir: Path | None) -> dict[str, Any]:
    """The plan of `cfg`, made in a child process; the layout keys given on the command line
    (grad_accum=4) are kept. Raises SpecError with the problems of a config no layout makes
    valid, or when no layout fits."""
    try:
        config = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "config"
        raise SpecError([f"{key}: {first_line(exc)}"]) from None
    request = {
        "config": config,
        "conf_dir": conf_dir,
        "run_dir": str(run_dir or ""),
        "fixed": _given_layout_keys(cfg),
    }
    child = planner_process.take()
    out, err = child.communicate(json.dumps(request))
    if child.returncode != 0:
        tail = err.strip().splitlines()[-1:] or [f"exit code {child.returncode}"]
        raise SpecError([f"parallelism=auto: planning the layout failed: {tail[0]}"])
    plan = json.loads(out)
    if "problems" in plan:
        if plan.get("plan"):  # what was weighed, where no layout fits
            raise NoneFits(plan["problems"], plan["plan"])
        raise SpecError(with_origins(plan["problems"], sys.argv[1:]))
    return plan


def _given_layout_keys(cfg: DictConfig) -> dict[str, Any]:
    """The layout keys a plan keeps: the degrees parallelism=auto's node sets, and grad_accum
    and activation_checkpointing where this job's command line gives them (Hydra's record);
    grad_accum=auto is the plan's to pick, as it would be unsaid."""
    from hydra.core.hydra_config import HydraConfig

    from runner.spec.plan_specs import FIXABLE

    given: dict[str, Any] = {
        key: cfg.parallelism[key.split(".")[1]]
        for key in FIXABLE
        if key.startswith("parallelism.") and cfg.parallelism.get(key.split(".")[1]) is not None
    }
    overrides = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
    keys = (o.lstrip("+").partition("=") for o in overrides)
    flat = {
        key: value for key, equals, value in keys if equals and not key.startswith("parallelism")
    }
    flat = {
        k: v for k, v in flat.items() if k in FIXABLE and not (k == "grad_accum" and v == "auto")
    }
    return {**given, **flat}


def chosen_row(plan: dict[str, Any]) -> dict[str, Any]:
    return next(r for r in plan["candidates"] if r["name"] == plan["chosen"])


def apply_layout(cfg: DictConfig, overrides: dict[str, Any], conf_dir: str) -> None:
    """Put a layout's keys into `cfg`: its engine's group option (the YAML's defaults), its
    mesh, activation_checkpointing and grad_accum, as ordinary keys."""
    options = group_option(Path(conf_dir), "parallelism", overrides["parallelism"])
    for key, value in overrides.items():
        if key.startswith("parallelism."):
            options[key.split(".", 1)[1]] = value
    with open_dict(cfg):
        cfg.parallelism = OmegaConf.create(options)
        for key in ("activation_checkpointing", "grad_accum"):
            if key in overrides:
                cfg[key] = overrides[key]


def planned_before(run_dir: Path) -> dict[str, Any] | None:
    """The plan a run in `run_dir` was started with (its plan.json), or None: none there, or
    one damaged (said, and planned again)."""
    from runner.rundir.files import read_json

    path = run_dir / PLAN_FILE
    plan = read_json(path)
    if isinstance(plan, dict) and plan.get("chosen"):
        return plan
    if path.exists():
        log.warning("runner: %s is damaged (not the plan runner wrote); planning again", path)
    return None


def peak_used(summary: dict[str, Any]) -> int | None:
    """The most memory any rank of a finished run used, as a plan's budget counts it: CUDA's
    most allocated, or resident memory above the rank's base; None where it says neither."""
    if summary.get("peak_device_bytes"):
        return max(summary["peak_device_bytes"])
    if summary.get("peak_rss_bytes") and summary.get("base_rss_bytes"):
        pairs = zip(summary["peak_rss_bytes"], summary["base_rss_bytes"], strict=True)
        return max(top - base for top, base in pairs)
    return None


def over_budget(plan: dict[str, Any], summary: dict[str, Any]) -> str | None:
    """What a run planned by parallelism=auto used beyond its budget, if it did (the most
    any rank used, measured as the plan measures: CUDA's most allocated, or resident memory
    above the base)."""
    from runner.spec.plan_specs import megabytes

    used = peak_used(summary)
    budget = plan.get("budget_bytes") or 0
    if used is None or not budget or used <= budget:
        return None
    return (
        f"runner: parallelism=auto: the run used {megabytes(used)} per rank, "
        f"{megabytes(used - budget)} over the budget of {megabytes(budget)} ({plan['budget']}); "
        f"its prediction was {megabytes(chosen_row(plan)['predicted']['peak_bytes'])}"
    )


def write_plan(run_dir: Path, plan: dict[str, Any]) -> None:
    from runner.rundir.files import write_json

    write_json(run_dir / PLAN_FILE, plan)


def plan_table(plan: dict[str, Any], shown: int = SHOWN, rest: str = f"in {PLAN_FILE}") -> str:
    """The plan as a terminal reads it: the fastest valid layouts, predicted (and measured,
    after trials), the pick marked; then how many were refused, and why. `rest`: where the
    layouts not shown are."""
    valid = sorted(
        (r for r in plan["candidates"] if r["valid"]), key=lambda r: r["predicted"]["step_s"]
    )
    measured = any("measured" in r for r in valid)
    head = f"{'':2}{'layout':34} {'state MB':>9} {'peak MB':>9} {'step s':>8}  fits"
    if measured:
        head += f"  {'measured s':>10} {'peak MB':>9}"
    lines = [
        f"runner: layout plan for {plan['world_size']} rank(s) on "
        f"{plan['device']['kind']} ({plan['device']['name']}); "
        f"budget {plan['budget_bytes'] / 2**20:,.0f} MB per rank ({plan['budget']})",
        head,
    ]
    chosen = plan.get("chosen")
    for row in valid[:shown] + [r for r in valid[shown:] if r["name"] == chosen]:
        predicted = row["predicted"]
        line = (
            f"{'*' if row['name'] == chosen else ' ':2}{row['name']:34} "
            f"{predicted['state_bytes'] / 2**20:9.1f} {predicted['peak_bytes'] / 2**20:9.1f} "
            f"{predicted['step_s']:8.3f}  {'yes' if row['fits'] else 'no'}"
        )
        got = row.get("measured")
        if got is not None and "failed" in got:
            line += f"  {'failed':>10}"
        elif got is not None:
            line += f"  {got['step_s']:10.3f} {got['peak_bytes'] / 2**20:9.1f}"
        lines.append(line)
    if len(valid) > shown:
        lines.append(f"  ... {len(valid) - shown} more valid layouts {rest}")
    refused = [r for r in plan["candidates"] if not r["valid"]]
    if refused:
        reasons = sorted({p for r in refused for p in r["problems"]})
        many = "layouts" if len(refused) != 1 else "layout"
        lines.append(f"  {len(refused)} {many} refused by the checks:")
        lines += [f"    - {reason}" for reason in reasons[:6]]
    if chosen:
        lines.append(f"  chosen: {chosen}  ({keys_text(chosen_row(plan)['overrides'])})")
    return "\n".join(lines)


def keys_text(overrides: dict[str, Any]) -> str:
    return " ".join(f"{key}={value}" for key, value in overrides.items())


class _Request:
    workdir: str = ""
    as_json: bool = False


def plan_argv(args: list[str]) -> list[str]:
    """Hydra's arguments for `runner plan ARGS [--json]`: the run's overrides,
    parallelism=auto, and a temporary run directory nothing is written to. `--json`: print
    the plan as plan.json holds it, not its table."""
    import atexit
    import shutil
    import tempfile

    _Request.workdir = tempfile.mkdtemp(prefix="runner-plan-")
    atexit.register(shutil.rmtree, _Request.workdir, True)
    _Request.as_json = "--json" in args
    args = [a for a in args if a != "--json"]
    given = [a for a in args if not a.startswith(("parallelism=", "+parallelism="))]
    if any(a.split("=", 1)[1] != "auto" for a in args if a not in given):
        print(
            "runner plan: weighs every layout; the parallelism given is left out", file=sys.stderr
        )
    return [
        *given,
        "parallelism=auto",
        f"hydra.run.dir={_Request.workdir}",
        "hydra.output_subdir=null",
    ]


def plan_task(cfg: DictConfig) -> None:
    """Hydra's task for `runner plan`: the plan, printed; nothing trains."""
    from runner.cli.conf_files import conf_dir
    from runner.spec.composed import problems_text

    try:
        plan = make_plan(cfg, conf_dir(), None)
    except SpecError as err:
        from runner.cli.interrupts import interrupted

        if interrupted():  # a refusal after Ctrl-C: the interruption cut the plan short
            raise KeyboardInterrupt from None
        if _Request.as_json and isinstance(err, NoneFits):  # every candidate, none fitting
            with contextlib.suppress(BrokenPipeError):
                print(json.dumps(err.plan, indent=2), flush=True)
        log.error("%s", problems_text(err.problems))
        sys.exit(2)
    try:
        print(json.dumps(plan, indent=2) if _Request.as_json else plan_table(plan, rest=LISTED))
        sys.stdout.flush()
    except BrokenPipeError:  # `runner plan --json | head`: the reader left
        reader_left()
        sys.exit(1)
