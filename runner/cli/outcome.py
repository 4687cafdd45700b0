"""Stage 9 in the parent: tell the user how the run ended, from its summary.json.

A failed run shows the root-cause rank's message, the last lines of its traceback (or of
its log, when it died without one), where the full log is, and how many ranks failed as
a consequence.
"""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path
from typing import Any

from runner.rundir.files import EVAL_FILE, RunDir
from runner.rundir.summary import Status

log = logging.getLogger("runner")


def report_outcome(summary: dict[str, Any], run_dir: RunDir) -> None:
    """One line for a completed run; the root cause for a failed one; where its files are."""
    if sys.stderr.isatty():  # a rank stopped mid-bar leaves the cursor on its line: clear it
        sys.stderr.write("\r\x1b[K")
    status = summary.get("status")
    final = summary.get("final", {})
    if status == Status.COMPLETED:
        keys = sorted(k for k in final if k.startswith("val/")) + ["train/loss"]
        parts = [f"{k} {final[k]:.4f}" for k in keys if k in final]
        parts += [step_time_text(final)] if "time/step_s" in final else []
        evaluated = (run_dir.root / EVAL_FILE).is_file()
        log.info(
            "runner: %s on %s rank(s) in %.1fs | %s",
            f"evaluated ({EVAL_FILE})" if evaluated else completed_what(summary),
            summary.get("world_size"),
            summary.get("wall_time_s", 0),
            " | ".join(parts),
        )
    elif status == Status.PRUNED:
        pruned = summary.get("pruned") or {}
        log.info(
            "runner: pruned after step %s by the sweep's pruner (%s %.4g); checkpoint %s",
            summary.get("steps"),
            pruned.get("metric"),
            pruned.get("value", math.nan),
            pruned.get("checkpoint"),
        )
    elif status == Status.FAILED and summary.get("error"):
        log.error("runner: %s", format_error(summary["error"], restarts=restarts_of(summary)))
    elif status == Status.INTERRUPTED:
        if not summary.get("stopped"):  # a graceful stop: the agent said where, with its step
            log.error("runner: %s", interrupted_line(summary, run_dir))
    else:
        log.error("runner: run %s after %s steps", status, summary.get("steps"))
    log.info("run directory: %s", shown(run_dir.root))


def completed_what(summary: dict[str, Any]) -> str:
    """`completed N steps`, and why it ended early where early_stop ended it."""
    what = f"completed {summary.get('steps')} steps"
    restarts = restarts_of(summary)
    if restarts:  # elastic restarts of this launch (each said as it happened)
        what += f" after {restarts} restart{'s' * (restarts > 1)}"
    early = summary.get("stopped_early")
    if early:
        what += (
            f", stopped early ({early['metric']} best {early['best']:.4g} at step "
            f"{early['best_step']}; no better in {early['patience']} evaluations)"
        )
    return what


TIME_PARTS = (  # time/... key, as the final line names it
    ("data", "data"),
    ("forward_backward", "fwd+bwd"),
    ("grad_sync", "grad sync"),
    ("optimizer", "optimizer"),
    ("host", "host"),
)


def step_time_text(final: dict[str, Any]) -> str:
    """`step 4.51 ms: data 0.42, fwd+bwd 2.41, grad sync 0.07, optimizer 1.49, host 0.11`
    (the last record's time/... keys: where a step's time went)."""
    times = [(name, final.get(f"time/{key}_s")) for key, name in TIME_PARTS]
    parts = ", ".join(f"{name} {_ms(value)}" for name, value in times if value is not None)
    return f"step {_ms(final['time/step_s'])} ms: {parts}"


def _ms(seconds: float) -> str:
    """Milliseconds to 3 significant digits, whole from 1000 on (`2,990`, not `2.99e+03`)."""
    ms = 1000 * seconds
    return f"{ms:,.0f}" if abs(ms) >= 999.5 else f"{ms:.3g}"


def interrupted_line(summary: dict[str, Any], run_dir: RunDir) -> str:
    """Where a run stopped by a signal stands: the last step its ranks finished (the last
    logged one where the agent could not tell), and what resume=auto goes on from."""
    from runner.rundir.checkpoints import CheckpointStore, step_of

    by = summary.get("signal") or "a signal"
    steps = summary.get("steps") or 0
    latest = CheckpointStore(run_dir.checkpoints, keep=1).latest()
    if not steps and latest is None and not summary.get("attempts"):  # no rank got to train
        return f"interrupted by {by} before the first step"
    # ranks that had started training, none of them past step 1 on every rank (a rank
    # interrupted in a step never finishes it, though another may have)
    where = f"after step {steps}" if steps else "before every rank had finished step 1"
    if latest is None:
        return f"interrupted by {by} {where}; no checkpoint yet: a new start begins at step 0"
    return (
        f"interrupted by {by} {where}; resume=auto goes on from its checkpoint of step "
        f"{step_of(latest)} ({shown(latest)})"
    )


def shown(path: Path) -> str:
    """`path` relative to the working directory when it lies below it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def restarts_of(summary: dict[str, Any]) -> int:
    """The elastic restarts of this launch: rank 0's count, else one per attempt after the
    first (a summary the agent wrote)."""
    return summary.get("restarts") or max(0, len(summary.get("attempts") or []) - 1)


def format_error(error: dict, traceback_lines: int = 15, restarts: int = 0) -> str:
    """The multi-line message the user sees for a failed run (from summary.json's `error`)."""
    after = f" after {restarts} restart{'s' * (restarts > 1)}" if restarts else ""
    lines = [f"run failed{after}: {error.get('message')}"]
    body = (error.get("traceback") or "").strip()
    label = "traceback (last lines)"
    if not body:
        body, label = (error.get("log_tail") or "").strip(), "last lines of its log"
    if body:
        lines.append(f"  {label}:")
        lines.extend("    " + line for line in body.splitlines()[-traceback_lines:])
    if error.get("log"):
        lines.append(f"  full log: {error['log']}")
    if error.get("other_failed_ranks"):
        lines.append(f"  ({error['other_failed_ranks']} other rank(s) failed as a consequence)")
    return "\n".join(lines)
