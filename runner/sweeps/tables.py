"""The sweep table: one row per job of a `runner -m` sweep, in sweep.csv and sweep.md.

Every job rewrites the table when it ends (under a lock, so jobs that a parallel
launcher runs at once never lose each other's rows), and Hydra's end-of-sweep
callback writes it a last time and prints it. A job is a directory of the sweep
holding `.hydra/overrides.yaml`; its row comes from that and its summary.json,
so jobs that failed or were rejected are listed like the others.
"""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from runner.errors import first_line
from runner.rundir.files import file_lock, write_atomic
from runner.rundir.summary import Status, how_it_ended
from runner.spec.slurm import submitit_problems
from runner.sweeps.job_dirs import job_dirs, metric_columns, overrides_of, run_config, shown
from runner.trackers.finish import finish_sweep_trackers

if TYPE_CHECKING:
    from runner.spec import RunSpec

SWEEP_CSV, SWEEP_MD = "sweep.csv", "sweep.md"


def sweep_rows(sweep_dir: Path) -> tuple[list[str], list[str], list[dict[str, Any]]]:
    """(overrides shared by every job, the final values shown, one row per job)."""
    jobs = [(job, overrides_of(job)) for job in job_dirs(sweep_dir)]
    metrics = metric_columns([run_config(job) for job, _ in jobs])
    shared = [o for o in jobs[0][1] if all(o in overrides for _, overrides in jobs)] if jobs else []
    rows = []
    for job, overrides in jobs:
        summary = how_it_ended(job).summary
        final = summary.get("final") or {}
        error = summary.get("error") or {}
        rows.append(
            {
                "job": job.name,
                "overrides": shown([o for o in overrides if o not in shared]),
                "status": summary.get("status", "running"),
                "steps": summary.get("steps", ""),
                "wall_time_s": summary.get("wall_time_s", ""),
                **{m: final.get(m, "") for m in metrics},
                "error": first_line(error.get("message") or "") if error else "",
            }
        )
    return shared, metrics, rows


def write_sweep_table(sweep_dir: Path) -> str:
    """Rewrite sweep.csv and sweep.md from the job directories; return the markdown."""
    with file_lock(sweep_dir / ".sweep.lock"):
        shared, metrics, rows = sweep_rows(sweep_dir)
        columns = ["job", "overrides", "status", "steps", "wall_time_s", *metrics, "error"]
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
        write_atomic(sweep_dir / SWEEP_CSV, buffer.getvalue())
        markdown = _markdown(shared, rows, columns)
        write_atomic(sweep_dir / SWEEP_MD, markdown)
    return markdown


def _markdown(shared: list[str], rows: list[dict[str, Any]], columns: list[str]) -> str:
    def cell(column: str, value: Any) -> str:
        if isinstance(value, float):
            text = f"{value:.1f}" if column == "wall_time_s" else f"{value:.4f}"
        else:
            text = str(value)
        return text.replace("|", "\\|")

    common = shown(shared) or "(none)"
    lines = [f"Sweep of {len(rows)} job(s); overrides of every job: {common}", ""]
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "---|" * len(columns))
    lines += ["| " + " | ".join(cell(c, row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def failed_jobs(sweep_dir: Path) -> list[str]:
    """Jobs that did not end as meant: neither completed nor pruned by the sweeper."""
    ended = (Status.COMPLETED, Status.PRUNED)
    return [row["job"] for row in sweep_rows(sweep_dir)[2] if row["status"] not in ended]


def unfinished_lines(sweep_dir: Path) -> list[str]:
    """What the sweep's end says of its jobs that did not end as meant: those that failed,
    and those stopped before their end (a signal, fail_fast), which go on when the same
    command runs again. Pruned jobs ended as the sweeper meant: not listed."""
    rows = sweep_rows(sweep_dir)[2]
    failed = [r["job"] for r in rows if r["status"] not in _ENDED + (Status.INTERRUPTED,)]
    stopped = [r["job"] for r in rows if r["status"] == Status.INTERRUPTED]
    lines = []
    if failed:
        lines.append(f"{len(failed)} job(s) failed: {', '.join(failed)}")
    if stopped:
        lines.append(
            f"{len(stopped)} job(s) stopped before their end: {', '.join(stopped)} (the same "
            "command again goes on from their last checkpoint)"
        )
    return lines


_ENDED = (Status.COMPLETED, Status.PRUNED)


class SweepTable(Callback):
    """Hydra callback (conf/config.yaml): the final sweep table, printed at the sweep's end."""

    failed: list[str] | None = None  # read by runner.cli.main for the exit code
    stopped_by: int | None = None  # the signal that stopped the sweep (its exit code)
    sweep_dir: Path | None = None  # read by runner.cli.main to discard a sweep that never ran
    # The directory's multirun.yaml before Hydra's sweeper writes this command's over it:
    # a refused resume (hydra/launcher=runner) puts it back.
    earlier_multirun: bytes | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        SweepTable.sweep_dir = Path(config.hydra.sweep.dir)
        earlier = SweepTable.sweep_dir / "multirun.yaml"
        SweepTable.earlier_multirun = earlier.read_bytes() if earlier.is_file() else None
        from runner.sweeps.resume import sweep_dir_problem

        problems = [p for p in (sweep_dir_problem(config), direction_problem(config)) if p]
        launcher = config.hydra.launcher
        if str(launcher.get("_target_", "")).endswith("SlurmLauncher"):  # before any job is sent
            problems += submitit_problems(launcher, config.get("nodes"), config.get("nproc"))
        if problems:  # before Hydra's sweeper writes multirun.yaml, or a job starts
            refuse_sweep(problems, SweepTable.sweep_dir)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if not sweep_dir.is_dir():
            return
        markdown = write_sweep_table(sweep_dir)
        SweepTable.failed = failed_jobs(sweep_dir)
        finish_sweep_trackers(
            sweep_dir, SweepTable.failed, [sweep_dir / SWEEP_CSV, sweep_dir / SWEEP_MD]
        )
        print(f"\n{markdown}\nsweep table: {sweep_dir / SWEEP_MD} (and {SWEEP_CSV})", flush=True)
        for line in unfinished_lines(sweep_dir):
            say(line)


def say(line: str) -> None:
    """A sweep's own lines (its launcher's, its sweeper's), on stderr beside the jobs'."""
    print(f"runner: {line}", file=sys.stderr, flush=True)


def refuse_sweep(problems: list[str], sweep_dir: Path) -> None:
    """Bad input found by a sweep's launcher or sweeper: reported like any configuration
    problem, exit 2, before the first job; the directory is left as it was."""
    from runner.spec.composed import problems_text

    print(problems_text(problems), file=sys.stderr, flush=True)
    record = sweep_dir / "multirun.yaml"
    if SweepTable.earlier_multirun is not None:  # the directory's own record, not this command's
        write_atomic(record, SweepTable.earlier_multirun)
    elif sweep_dir.is_dir():  # nothing of this command stays behind
        record.unlink(missing_ok=True)
        if not any(sweep_dir.iterdir()):
            sweep_dir.rmdir()
    sys.exit(2)


def sweeper_problem(sweeper: Any, spec: RunSpec) -> str | None:
    """An Optuna sweep that optimizes the other way from sweep.direction."""
    direction = sweeper.get("direction") if hasattr(sweeper, "get") else None
    if not isinstance(direction, str) or "optuna" not in str(sweeper.get("_target_", "")):
        return None  # no direction to agree with (several objectives: the user's own)
    if direction.lower() == spec.sweep.direction:
        return None
    return (
        f"hydra.sweeper.direction={direction}: each job returns its final {spec.sweep.metric} "
        f"(sweep.metric), which is to {spec.sweep.direction} (sweep.direction); set "
        f"hydra.sweeper.direction={spec.sweep.direction}, or sweep.direction to say otherwise"
    )


def direction_problem(config: DictConfig) -> str | None:
    """sweeper_problem as the sweep starts, before Hydra lists its jobs: from the sweep's
    own config (None where that does not resolve without a job's overrides: each job then
    checks it)."""
    from omegaconf import OmegaConf

    from runner.spec import resolve_spec

    sweeper = config.hydra.sweeper
    if "optuna" not in str(sweeper.get("_target_", "")):
        return None
    task = OmegaConf.masked_copy(config, [k for k in config if k != "hydra"])
    try:
        spec = resolve_spec(OmegaConf.to_container(task, resolve=True))  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001  (a job reports its own problems, SpecError and others)
        return None
    return sweeper_problem(sweeper, spec)
