"""plan.trials=K: the K fastest predicted layouts that fit, each run for plan.trial_steps
steps (a real launch each, one after the other, as a sweep's jobs run), timed and measured;
the fastest measured one that fits is the pick.

A trial is `runner rerun` of the run's config with the candidate's keys, into the run
directory's `plan_trials/N/`, without checkpoints, trackers or a progress bar. Its step time
is the median of `time/step_s` over its steps after the first (the first builds caches and
compiles); its memory is the most any rank used (above its base on a CPU; CUDA's most
allocated on a GPU). A trial that fails is recorded with its error, and never picked.

Without trials, a pick predicted within plan.check_margin of the budget is checked the same
way (`check_pick`): one trial at a time, in the prediction's order, until one is measured
within the budget or predicted well inside it.

A trial measured within the budget keeps room in it for what a rank's peak grows after the
trial's few steps (`needed`: LATER_GROWTH, at least LATER_GROWTH_FLOOR, by the device).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from runner.cli.layout_plan import apply_layout, chosen_row, keys_text, peak_used
from runner.spec import SpecError
from runner.spec.composed import resolve_cfg
from runner.spec.config_file import save_spec
from runner.spec.plan_specs import (
    CHECK_MARGIN,
    LATER_GROWTH,
    LATER_GROWTH_FLOOR,
    MORE,
    megabytes,
    shortfall,
)

log = logging.getLogger("runner")
TRIALS_DIR = "plan_trials"


def run_trials(
    cfg: DictConfig, plan: dict[str, Any], run_dir: Path, conf_dir: str
) -> dict[str, Any]:
    """`plan` with each trial's `measured` figures, its `trials` (the names run, in order)
    and its `chosen` the fastest one measured within the budget. A candidate measured over
    the budget no longer `fits`, and the next fastest predicted one is tried in its place
    (at most `trials` more); none within it raises SpecError, naming the shortfall. Where
    every trial failed, the prediction picks (said)."""
    trials, steps = int(cfg.plan.trials), int(cfg.plan.trial_steps)
    budget = plan["budget_bytes"]
    fitting = [r for r in plan["candidates"] if r["valid"] and r["fits"]]
    queue = sorted(fitting, key=lambda r: r["predicted"]["step_s"])[: 2 * trials]
    plan["trials"] = []
    within: list[dict[str, Any]] = []
    over: list[dict[str, Any]] = []
    for number, row in enumerate(queue):
        if number - len(over) >= trials:  # as many trials as asked, besides those over it
            break
        log.info("runner: plan trial %d: %s, %d steps", number + 1, row["name"], steps)
        got = _trial(cfg, row["overrides"], run_dir / TRIALS_DIR / str(number), conf_dir, steps)
        row["measured"] = got
        plan["trials"].append(row["name"])
        if "peak_bytes" in got and needed(plan, got) > budget:
            row["fits"] = False  # measured over the budget: never the pick
            over.append(row)
            log.warning("runner: plan trial %s %s; trying the next", row["name"],
                        _over(plan, got))  # fmt: skip
        elif "step_s" in got:
            within.append(row)
    if within:
        plan["chosen"] = min(within, key=lambda r: r["measured"]["step_s"])["name"]
    elif over:
        raise SpecError([_shortfall(plan, over, "trialled", "or plan.trials=0 to train the "
                                    "prediction's pick")])  # fmt: skip
    else:
        log.warning("runner: no plan trial completed; the prediction picks")
    return plan


CHECKED = 4  # layouts a check runs at most before it gives up


def needed(plan: dict[str, Any], got: dict[str, Any]) -> float:
    """What a layout measured in a trial needs of the budget: its peak, and room for what a
    rank's peak still grows after the trial's steps (`_room`)."""
    return got["peak_bytes"] + _room(plan, got)


def _room(plan: dict[str, Any], got: dict[str, Any]) -> float:
    """LATER_GROWTH of the measured peak, and at least LATER_GROWTH_FLOOR, by the device."""
    kind = plan["device"]["kind"]
    return max(got["peak_bytes"] * LATER_GROWTH[kind], LATER_GROWTH_FLOOR[kind])


def _over(plan: dict[str, Any], got: dict[str, Any]) -> str:
    budget = plan["budget_bytes"]
    over = needed(plan, got) - budget
    return f"{_used(plan, got)}, {megabytes(over)} over the budget of {megabytes(budget)}"


def _within(plan: dict[str, Any], got: dict[str, Any]) -> str:
    return f"{_used(plan, got)}, within the budget of {megabytes(plan['budget_bytes'])}"


def _used(plan: dict[str, Any], got: dict[str, Any]) -> str:
    """What a checked layout used, and the room kept for later steps."""
    growth, room = LATER_GROWTH[plan["device"]["kind"]], _room(plan, got)
    more = f"{growth:.0%}" if room == got["peak_bytes"] * growth else megabytes(room)
    return f"used {megabytes(got['peak_bytes'])} per rank; with {more} more for later steps"


def check_margin(cfg: DictConfig, plan: dict[str, Any]) -> float:
    """plan.check_margin, or where it is null the device's (CHECK_MARGIN)."""
    given = cfg.plan.check_margin
    return float(given) if given is not None else CHECK_MARGIN[plan["device"]["kind"]]


def needs_check(cfg: DictConfig, plan: dict[str, Any]) -> bool:
    """Whether the pick is predicted close enough to the budget (within plan.check_margin of
    it) that it runs a few steps first (plan.trials=0, one node)."""
    margin = check_margin(cfg, plan)
    if cfg.plan.trials or margin <= 0 or str(cfg.nodes) != "1":
        return False
    return chosen_row(plan)["predicted"]["peak_bytes"] > (1 - margin) * plan["budget_bytes"]


def check_pick(
    cfg: DictConfig, plan: dict[str, Any], run_dir: Path, conf_dir: str
) -> dict[str, Any]:
    """The budget kept where the prediction is close to it: the fastest predicted layouts
    that fit (those whose prediction leaves the room for later steps first), in order, each
    run for plan.trial_steps steps (a trial) while it is predicted within plan.check_margin
    of the budget; the first measured within the budget, or
    predicted well inside it, is the pick. One measured over it (or failing) no longer
    fits, and what it measured beyond its prediction is added to the predictions of the
    rest (a rank's memory besides the traced tensors is much the same in every layout): a
    layout that no longer fits with it is passed over. After CHECKED such trials, SpecError
    names the least one's shortfall."""
    budget, steps = plan["budget_bytes"], int(cfg.plan.trial_steps)
    safe = (1 - check_margin(cfg, plan)) * budget
    fitting = [r for r in plan["candidates"] if r["valid"] and r["fits"]]
    plan["trials"] = []
    tried: list[dict[str, Any]] = []
    beyond, raised_by = 0, ""  # the most a checked layout measured beyond its prediction
    for row in sorted(fitting, key=lambda r: (_no_room(plan, r), r["predicted"]["step_s"])):
        predicted = row["predicted"]["peak_bytes"] + beyond
        if beyond:
            row["raised_peak_bytes"] = predicted  # plan.json: the prediction the check used
        if predicted > budget:  # as the checks measured, it would not fit either
            row["fits"] = False
            continue
        at = f"predicted at {megabytes(predicted)} of {megabytes(budget)} per rank{raised_by}"
        if predicted <= safe:
            plan["chosen"] = row["name"]
            log.info("runner: parallelism=auto: %s is %s, well inside it: it trains (%s)",
                     row["name"], at, keys_text(row["overrides"]))  # fmt: skip
            return plan
        if len(tried) == CHECKED:
            break
        log.info("runner: parallelism=auto: %s is %s; checking it for %d steps",
                 row["name"], at, steps)  # fmt: skip
        trial_dir = run_dir / TRIALS_DIR / str(len(tried))
        got = _trial(cfg, row["overrides"], trial_dir, conf_dir, steps)
        row["measured"] = got
        plan["trials"].append(row["name"])
        tried.append(row)
        if "peak_bytes" in got and needed(plan, got) <= budget:
            plan["chosen"] = row["name"]
            log.info("runner: parallelism=auto: %s %s; it trains (%s)", row["name"],
                     _within(plan, got), keys_text(row["overrides"]))  # fmt: skip
            return plan
        if "peak_bytes" in got and got["peak_bytes"] - row["predicted"]["peak_bytes"] > beyond:
            beyond = got["peak_bytes"] - row["predicted"]["peak_bytes"]
            raised_by = f" (with the {megabytes(beyond)} {row['name']} used beyond its own)"
        row["fits"] = False
        why = got.get("failed") or _over(plan, got)
        log.warning("runner: parallelism=auto: %s %s; trying the next", row["name"], why)
    return _none_within(plan, tried, budget, beyond)


def _no_room(plan: dict[str, Any], row: dict[str, Any]) -> bool:
    """Whether `row`'s prediction leaves no room in the budget for later steps: its check
    would pass only where the prediction is high, so the layouts that leave it are checked
    first."""
    return needed(plan, row["predicted"]) > plan["budget_bytes"]


def _none_within(
    plan: dict[str, Any], tried: list[dict[str, Any]], budget: int, beyond: float
) -> dict:
    """SpecError: no checked layout ran within the budget; the least one's need, and how many
    were left unchecked that still fit, raised by `beyond`."""
    ran = [r for r in tried if "peak_bytes" in r["measured"]]
    if not ran:
        failed = f" ({tried[0]['name']}: {tried[0]['measured'].get('failed')})" if tried else ""
        raise SpecError([f"parallelism=auto: no layout checked ran{failed}"])
    unchecked = [
        r for r in plan["candidates"] if r["valid"] and r["fits"] and "measured" not in r
        and r["predicted"]["peak_bytes"] + beyond <= budget
    ]  # fmt: skip
    more = (
        f"{MORE}; {len(unchecked)} more that may fit were not checked ({CHECKED} checks at most)"
        if unchecked
        else MORE
    )
    raise SpecError([_shortfall(plan, ran, "checked", more)])


def _shortfall(plan: dict[str, Any], over: list[dict[str, Any]], how: str, more: str) -> str:
    """No layout `how` (trialled, checked) ran within the budget: the least one's need."""
    least = min(over, key=lambda r: r["measured"]["peak_bytes"])
    need = needed(plan, least["measured"])
    what = f"{how} ran within"
    return shortfall(what, plan["budget_bytes"], plan["budget"], least["name"], need, more)


def _trial(
    cfg: DictConfig, overrides: dict[str, Any], trial_dir: Path, conf_dir: str, steps: int
) -> dict[str, Any]:
    """Run one candidate for `steps` steps in `trial_dir`; what it measured, or its error."""
    trial = copy.deepcopy(cfg)
    apply_layout(trial, overrides, conf_dir)
    with tempfile.TemporaryDirectory(prefix="runner-trial-") as source:
        spec, secrets = resolve_cfg(trial, Path(source))
        save_spec(spec, source, secrets)
        command = [
            sys.executable, "-m", "runner.cli.entry", "rerun", source,
            f"max_steps={steps}", "max_epochs=null", "checkpoint.interval=null",
            "eval_batches=1", "eval_interval=null", "log_interval=1", "logger=none",
            "progress_bar=false", "early_stop.patience=null", f"hydra.run.dir={trial_dir}",
        ]  # fmt: skip
        done = _run_trial(command)
    summary = _read(trial_dir / "summary.json")
    if done.returncode != 0 or summary.get("status") != "completed":
        message = (summary.get("error") or {}).get("message") or _tail(done.stderr)
        return {"failed": message, "run_dir": str(trial_dir)}
    for kept in ("checkpoints", "model.pt", "model.safetensors"):  # its figures are the point
        path = trial_dir / kept
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    return {**measured(trial_dir, summary), "run_dir": str(trial_dir)}


def _run_trial(command: list[str]) -> subprocess.CompletedProcess:
    """The trial's command, in a session of its own: stopped here (Ctrl-C, SIGTERM), this
    process stops the trial (SIGTERM, which its launcher relays to its agent and ranks) and
    waits for it to end before the caller goes on (it removes the trial's directory), where
    the trial's agent had written into it after its launcher was gone."""
    import os
    import signal

    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    ) as proc:  # fmt: skip
        try:
            out, err = proc.communicate()
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


STOP_SECONDS = 60  # a stopped trial's time to end (its ranks stop at their next step)


def measured(run_dir: Path, summary: dict[str, Any]) -> dict[str, Any]:
    """A finished run's step time (the median over its steps after the first) and the most
    memory any rank used: CUDA's most allocated, or resident memory above the base."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    times = [r["time/step_s"] for r in records if r.get("step", 0) > 1 and "time/step_s" in r]
    step_s = statistics.median(times) if times else float("nan")
    return {"step_s": step_s, "peak_bytes": peak_used(summary)}


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _tail(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"
