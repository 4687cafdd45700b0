"""`runner-report RUN_OR_SWEEP_DIR...`: compare runs side by side, and plot their losses.

Prints one table row per run: the config values that differ between the runs,
then status, steps, wall time and final metrics. Writes a PNG with the train
and validation loss curves next to the runs (inside the directory given, or in
the common parent of several). A sweep directory stands for all of its jobs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from runner.cli.closed_pipe import reader_left
from runner.rundir.files import RunDir, read_jsonl
from runner.rundir.summary import how_it_ended
from runner.sweeps.job_dirs import job_order, metric_columns, run_config

REPORT_PNG = "report.png"


def find_runs(paths: list[Path]) -> list[Path]:
    """Run directories among `paths`: each path is a run, or a directory of runs (a sweep)."""
    runs: list[Path] = []
    for path in paths:
        if _is_run(path):
            runs.append(path)
        elif path.is_dir():
            children = [p for p in path.iterdir() if p.is_dir() and _is_run(p)]
            runs += sorted(children, key=job_order)
    return runs


def _is_run(path: Path) -> bool:
    return RunDir(path).summary.is_file() or (path / "config.yaml").is_file()


def differing_keys(runs: list[Path], configs: list[dict[str, Any]]) -> list[str]:
    """Config keys whose values differ between runs. A rejected sweep job only has its
    unresolved config: its missing keys and `auto` values are not a difference."""
    resolved = [(run / "config.yaml").is_file() for run in runs]
    differing = []
    for key in sorted({k for c in configs for k in c}):
        values: list[Any] = []
        for config, is_resolved in zip(configs, resolved, strict=True):
            if is_resolved:
                values.append(config.get(key))
            elif key in config and config[key] != "auto":
                values.append(config[key])
        if any(v != values[0] for v in values[1:]):
            differing.append(key)
    # When runs use different options of a group (parallelism=ddp vs zero2), the keys that only
    # one option has are no news: `parallelism.name` already says it.
    switched = {key.rsplit(".", 1)[0] for key in differing if key.endswith(".name")}
    return [
        key
        for key in differing
        if key.endswith(".name")
        or key.split(".", 1)[0] not in switched
        or all(key in config for config, ok in zip(configs, resolved, strict=True) if ok)
    ]


def label(run: Path, base: Path) -> str:
    try:
        return str(run.relative_to(base)) or run.name
    except ValueError:
        return str(run)


def rows(runs: list[Path], base: Path) -> tuple[list[str], list[dict[str, Any]]]:
    """(columns, one row per run) for the comparison table."""
    configs = [run_config(run) for run in runs]
    keys = differing_keys(runs, configs) if len(runs) > 1 else []
    metrics = metric_columns(configs)
    table = []
    for run, config in zip(runs, configs, strict=True):
        summary = how_it_ended(run).summary or _so_far(run)
        final = summary.get("final") or {}
        row = {"run": label(run, base), **{k: config.get(k, "") for k in keys}}
        row.update(
            status=summary.get("status", "running"),
            steps=summary.get("steps", ""),
            wall_time_s=summary.get("wall_time_s", ""),
        )
        row.update({m: final.get(m, "") for m in metrics})
        row.update({c: _ms(final.get(k)) for c, k in STEP_TIME_COLUMNS.items()})
        table.append(row)
    times = [c for c in STEP_TIME_COLUMNS if any(row[c] != "" for row in table)]
    columns = ["run", *keys, "status", "steps", "wall_time_s", *metrics, *times]
    return columns, table


# where a step's time went, in the run's last record (milliseconds a step)
STEP_TIME_COLUMNS = {
    "step_ms": "time/step_s",
    "data_ms": "time/data_s",
    "fwd_bwd_ms": "time/forward_backward_s",
    "grad_sync_ms": "time/grad_sync_s",
    "optimizer_ms": "time/optimizer_s",
    "host_ms": "time/host_s",
}


def _ms(seconds: Any) -> Any:
    return 1000 * seconds if isinstance(seconds, (int, float)) else ""


def _so_far(run: Path) -> dict[str, Any]:
    """A run without a summary (still running): its latest values from metrics.jsonl."""
    final: dict[str, Any] = {}
    for record in read_jsonl(run / "metrics.jsonl"):
        final.update(record)
    return {"final": final, "steps": final.get("step", "")} if final else {}


def print_table(columns: list[str], table: list[dict[str, Any]]) -> None:
    """The runs' table; where a step's time went (its parts) in a second one below, so that
    the metrics keep their names on a narrow terminal."""
    from rich.console import Console

    # On a terminal rich fits a table to its width; piped, keep every column whole.
    console = Console(width=None if sys.stdout.isatty() else 10_000)
    parts = [c for c in columns if c in STEP_TIME_COLUMNS and c != "step_ms"]
    console.print(_table([c for c in columns if c not in parts], table))
    if parts:
        total = ["step_ms"] if "step_ms" in columns else []
        console.print(_table(["run", *total, *parts], table, "where a step's time went (ms)"))


def _table(columns: list[str], table: list[dict[str, Any]], title: str | None = None) -> Any:
    from rich.table import Table

    view = Table(show_lines=False, title=title, title_justify="left")
    for column in columns:
        numeric = column.startswith(("val/", "train/")) or column in ("steps", "wall_time_s")
        numeric = numeric or column in STEP_TIME_COLUMNS
        # on a narrow terminal a cell wraps onto more lines rather than lose its end
        header = column.removesuffix("_ms") if title else column  # the title says ms
        view.add_column(header, justify="right" if numeric else "left", overflow="fold")
    for row in table:
        view.add_row(*(_cell(column, row[column]) for column in columns))
    return view


def _cell(column: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.1f}" if column == "wall_time_s" else f"{value:.4g}"
    if value is None:
        return "null"
    return str(value)


def plot_losses(runs: list[Path], base: Path, out: Path) -> Path:
    """Train loss (line) and validation loss (line with markers) per run, against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (train_ax, val_ax) = plt.subplots(1, 2, figsize=(12, 4.5), sharex=True)
    for run in runs:
        records = read_jsonl(run / "metrics.jsonl")
        name = label(run, base)
        train = [(r["step"], r["train/loss"]) for r in records if "train/loss" in r]
        val = [(r["step"], r["val/loss"]) for r in records if "val/loss" in r]
        if train:
            marker = "." if len(train) < 30 else None  # a short run is still visible
            train_ax.plot(*zip(*train, strict=True), marker=marker, label=name)
        if val:
            val_ax.plot(*zip(*val, strict=True), marker="o", markersize=3, label=name)
    for ax, title in ((train_ax, "train/loss"), (val_ax, "val/loss")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    val_ax.legend(fontsize="small", loc="upper right")
    fig.tight_layout()
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="runner-report",
        description="Compare runs (or the jobs of sweeps): a table of the config values "
        "that differ and the final metrics, and a PNG of their loss curves.",
    )
    parser.add_argument("dirs", nargs="+", type=Path, help="run or sweep directories")
    parser.add_argument(
        "--out", type=Path, help=f"the PNG to write (default: {REPORT_PNG} next to the runs)"
    )
    parser.add_argument(
        "--watch",
        type=float,
        metavar="SECONDS",
        help="redraw the table and the PNG every SECONDS (a sweep's new jobs included) "
        "until Ctrl-C",
    )
    args = parser.parse_args(argv)
    try:  # the `report` extra: not every machine that trains draws plots
        import matplotlib  # noqa: F401
        import rich  # noqa: F401
    except ImportError as exc:
        print(
            f"runner-report needs matplotlib and rich ({exc}); install them with "
            "pip install 'runner[report]'",
            file=sys.stderr,
        )
        return 2

    missing = [str(p) for p in args.dirs if not p.is_dir()]
    if missing:
        print(f"runner-report: no such directory: {', '.join(missing)}", file=sys.stderr)
        return 2
    paths = [p.resolve() for p in args.dirs]
    if args.watch is not None and args.watch <= 0:
        print(f"runner-report: --watch {args.watch}: give seconds above 0", file=sys.stderr)
        return 2
    runs = find_runs(paths)
    if not runs and args.watch is None:
        shown = ", ".join(str(p) for p in args.dirs)
        print(
            f"runner-report: no runs in {shown} (a run directory holds summary.json or "
            "config.yaml; a sweep directory holds such directories)",
            file=sys.stderr,
        )
        return 2
    if len(paths) == 1:  # one run or one sweep: the PNG goes inside it
        base = paths[0].parent if _is_run(paths[0]) else paths[0]
        out = args.out or paths[0] / REPORT_PNG
    else:  # several: next to them, in their common parent
        base = Path(os.path.commonpath(paths))
        out = args.out or base / REPORT_PNG
    try:
        return _watch(paths, base, out, args.watch) if args.watch else _report(runs, base, out)
    except BrokenPipeError:  # `runner-report ... | head`: the reader left (rich: exit 1 too)
        reader_left()
        return 1


def _report(runs: list[Path], base: Path, out: Path) -> int:
    columns, table = rows(runs, base)
    print_table(columns, table)
    print(f"loss curves: {plot_losses(runs, base, out)}", flush=True)
    return 0


def _watch(paths: list[Path], base: Path, out: Path, seconds: float) -> int:
    """The report again every `seconds` (runs found anew: a sweep's jobs as they start),
    on a terminal in place of the last one; Ctrl-C ends it."""
    import signal
    import time

    from rich.console import Console

    stopped: list[int] = []

    def stop(signum: int, _frame: object) -> None:
        stopped.append(signum)  # a flag, not an exception: the drawing code may swallow one

    for signum in (signal.SIGINT, signal.SIGTERM):  # also where a parent ignores Ctrl-C
        signal.signal(signum, stop)
    console = Console()
    while not stopped:
        runs = find_runs(paths)
        if console.is_terminal:
            console.clear()
        print(time.strftime("%H:%M:%S"), flush=True)
        if runs:
            _report(runs, base, out)
        else:
            print("runner-report: no runs yet", flush=True)
        until = time.monotonic() + seconds
        while not stopped and time.monotonic() < until:
            time.sleep(min(0.1, seconds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
