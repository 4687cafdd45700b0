"""The benchmark harness every suite shares: a configuration, how commands run (runner, and
torchrun with the plain script, timed from inside or outside), metric names, and the table
of interleaved repetitions (medians, min-max, ratios against a baseline).

Run from benchmarks/ as scripts (`make bench`), so suites import it as `harness`.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
WARMUP = 5  # steps excluded from every timing
STEP = "s/step"
SPS = "samples/s"
FIRST = "s to first step"
STATE = "state MB/rank"  # parameters + gradients + optimizer state (summary.json state_bytes)
MB = 1024 * 1024
ITEMS = "images or tokens/s"
# compared with the baseline in every suite (a suite may name more); the rest shown as is
RATIO_METRICS = (STEP, FIRST, SPS, STATE, ITEMS)
GPU_NAME: list[str] = []  # filled by the gpu suite, for the table's machine line


def thread_env(nproc: int, threads: int | None = None) -> dict[str, str]:
    """Identical threading for runner and the baseline: cores split among local ranks.

    torchrun sets only OMP_NUM_THREADS; MKL would otherwise start threads of its own
    in every rank and oversubscribe the cores (measured here: 0.60 vs 0.49 s/step).
    """
    count = str(threads or max(1, (os.cpu_count() or 1) // nproc))
    names = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
    return {**os.environ, **dict.fromkeys(names, count)}


@dataclass
class Config:
    name: str
    measure: Callable[[], dict[str, float]]  # metrics of one run
    baseline: str | None = None  # the configuration ratios compare with (default: the first)


def venv_tool(name: str) -> str:
    """A console script of this environment (`runner`, `torchrun`), as a user would call it."""
    return str(Path(sys.executable).parent / name)


def run(command: list[str], env: dict[str, str], cwd: str | None = None) -> str:
    """Run one benchmarked command; its stdout. A failure stops the suite with its stderr."""
    proc = subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-25:])
        sys.exit(f"benchmark command failed (exit {proc.returncode}): {' '.join(command)}\n{tail}")
    return proc.stdout


def time_command(command: list[str], cwd: str, nproc: int) -> tuple[float, float, str]:
    """Wall seconds of the whole command, its start as unix time, and its stdout."""
    start = time.time()
    stdout = run(command, thread_env(nproc), cwd=cwd)
    return time.time() - start, start, stdout


def run_runner(
    *overrides: str, nproc: int, steps: int, threads: int | None = None
) -> dict[str, float]:
    """One runner run: seconds per step from its metrics (steps after WARMUP, evaluation
    excluded), and the largest rank's optimizer state and peak RSS from its summary."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        command = [venv_tool("runner"), *overrides, f"nproc={nproc}", "max_epochs=null"]
        command += [f"max_steps={steps}", f"log_interval={WARMUP}", "progress_bar=false"]
        command += [f"hydra.run.dir={run_dir}"]
        env = thread_env(nproc, threads)
        run(command, env, cwd=tmp)
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        batch = yaml.safe_load((run_dir / "config.yaml").read_text())["global_batch_size"]
        summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in lines]
    intervals = [batch / r["throughput/samples_per_sec"] for r in records if r["step"] > WARMUP]
    return {
        STEP: statistics.fmean(intervals),
        SPS: batch / statistics.fmean(intervals),
        STATE: max(rank["total"] for rank in summary["state_bytes"]) / MB,
        "optimizer state MB/rank": max(summary["optimizer_state_bytes"]) / MB,
        "peak RSS MB/rank": max(summary["peak_rss_bytes"]) / MB,
    }


def plain_command(
    *args: str, nproc: int, steps: int, warmup: int = WARMUP, script: str = "plain_ddp.py"
) -> list[str]:
    command = [venv_tool("torchrun"), "--standalone", f"--nproc-per-node={nproc}"]
    command += [str(REPO / "benchmarks" / script), f"--steps={steps}"]
    return [*command, f"--warmup={warmup}", *args]


def run_plain(
    *args: str, nproc: int, steps: int, threads: int | None = None, script: str = "plain_ddp.py"
) -> dict[str, float]:
    """One run of a plain script (plain_ddp.py, or plain_gpt.py: nanoGPT's way)."""
    command = plain_command(*args, nproc=nproc, steps=steps, script=script)
    stdout = run(command, thread_env(nproc, threads))
    result = json.loads(stdout.strip().splitlines()[-1])
    batch = int(next(a.split("=")[1] for a in args if a.startswith("--global-batch-size")))
    return {
        STEP: result["sec_per_step"],
        SPS: batch / result["sec_per_step"],
        STATE: result["state_bytes"] / MB,
        "optimizer state MB/rank": result["optimizer_state_bytes"] / MB,
        "peak RSS MB/rank": result["peak_rss_bytes"] / MB,
    }


# --- B1 + B2: per-step overhead and time to first step, timed from outside -------------


def outside_runner(
    model: str,
    steps: int,
    nproc: int = 2,
    prestart: bool = True,
    extra: tuple[str, ...] = (),
    batch: int = 64,
) -> tuple[float, float]:
    """(wall seconds, seconds from the command's start to the first optimizer step done).

    Without `prestart` the run goes through `python -m runner.cli.main`, which starts the
    launcher only after Hydra is done (the console script `runner` starts it first).
    """
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        command = [venv_tool("runner")] if prestart else [sys.executable, "-m", "runner.cli.main"]
        command += [f"model={model}", "data=synthetic", f"nproc={nproc}"]
        command += [f"global_batch_size={batch}", f"max_steps={steps}", "max_epochs=null"]
        command += ["eval_interval=1000000", f"hydra.run.dir={run_dir}"]  # eval: last step only
        wall, start, _ = time_command([*command, *extra], tmp, nproc)
        first = json.loads((run_dir / "summary.json").read_text())["first_step_at"]
    return wall, first - start


def outside_plain(
    model: str, steps: int, nproc: int = 2, batch: int = 64, extra: tuple[str, ...] = ()
) -> tuple[float, float]:
    args = (f"--model={model}", f"--global-batch-size={batch}", *extra)
    with tempfile.TemporaryDirectory() as tmp:
        command = plain_command(*args, nproc=nproc, steps=steps, warmup=0)
        wall, start, stdout = time_command(command, tmp, nproc)
    first = json.loads(stdout.strip().splitlines()[-1])["first_step_at"]
    return wall, first - start


RESNET = ["model=resnet18", "data=synthetic", "global_batch_size=64"]


def plain_resnet(grad_accum: int, steps: int, nproc: int = 2, threads: int | None = None) -> Config:
    args = ("--model=resnet18", f"--grad-accum={grad_accum}", "--global-batch-size=64")
    label = "plain PyTorch DDP" + (" (no_sync)" if grad_accum > 1 else "")
    return Config(label, lambda: run_plain(*args, nproc=nproc, steps=steps, threads=threads))


def runner_row(name: str, overrides: tuple[str, ...], steps: int) -> Config:
    return Config(name, lambda: run_runner(*overrides, nproc=2, steps=steps))


def machine() -> str:
    gpus = f"{GPU_NAME[0]}, " if GPU_NAME else ""
    return (
        f"{gpus}{os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
        f"torch {metadata.version('torch')}, deepspeed {metadata.version('deepspeed')}, "
        f"python {platform.python_version()}, {time.strftime('%Y-%m-%d')}"
    )


def _cell(values: list[float], digits: int) -> str:
    digits = 0 if _counts(values) else digits
    median, low, high = statistics.median(values), min(values), max(values)
    return f"{median:.{digits}f} ({low:.{digits}f}-{high:.{digits}f})"


def _counts(values: list[float]) -> bool:
    """Whole numbers (steps, a trial's number): shown without decimals."""
    return all(float(v).is_integer() for v in values)


def _plain(values: list[float]) -> str:
    """A metric without a ratio: its median; fractions below 1 to four places."""
    median = statistics.median(values)
    if _counts(values):
        return f"{median:.0f}"
    return f"{median:.4f}" if abs(median) < 1 else f"{median:.1f}"


@dataclass
class Suite:
    title: str
    build: Callable[[int], list[Config]]  # steps -> the configurations, baseline first
    how: str | None = None  # how it measures, for the table; None: steps from inside
    ratios: tuple[str, ...] = ()  # more metrics compared with the baseline
    # what the medians say, under the table: {configuration: {metric: median}} -> lines
    notes: Callable[[dict[str, dict[str, float]]], list[str]] | None = None


def run_suite(suite: Suite, reps: int, steps: int, deadline: float | None = None) -> str:
    """Every configuration `reps` times, the order rotated each repetition so that slow drift
    of the machine hits each alike; the table in markdown. `deadline` (time.monotonic()):
    no measurement starts after it, and the table holds what was measured by then (none:
    an empty string)."""
    title, configs = suite.title, suite.build(steps)
    results: dict[str, list[dict[str, float]]] = {c.name: [] for c in configs}
    for rep in range(reps):
        shift = rep % len(configs)
        for config in configs[shift:] + configs[:shift]:
            if deadline is not None and time.monotonic() > deadline:
                break
            results[config.name].append(config.measure())
            print(
                f"  rep {rep + 1}/{reps} {config.name}: {results[config.name][-1]}",
                file=sys.stderr,
                flush=True,
            )
    unmeasured = [c.name for c in configs if not results[c.name]]
    configs = [c for c in configs if results[c.name]]
    if not configs:
        return ""  # nothing measured before the deadline: no table
    compared = (*RATIO_METRICS, *suite.ratios)
    metrics = list(results[configs[0].name][0])
    header = ["configuration"]
    for metric in metrics:
        header.append(f"{metric} median (min-max)" if metric in compared else metric)
        if metric in compared:
            header.append("ratio")
    how = (
        suite.how
        or f"{steps} steps per run, the first {WARMUP} not timed (the processes' own clocks)"
    )
    lines = [
        f"### {title}",
        "",
        f"Machine: {machine()}. {reps} interleaved repetitions; {how}. Ratios: median against "
        "the median of the baseline it is paired with (plain PyTorch unless the title says "
        "otherwise). Memory: the largest rank.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for config in configs:
        baseline = results[config.baseline or configs[0].name]
        cells = [config.name]
        for metric in metrics:
            values = [r[metric] for r in results[config.name]]
            if metric in compared:
                small = metric == STEP and statistics.median(values) < 0.05  # ms-scale steps
                cells.append(
                    _cell(values, 1 if metric in (SPS, STATE, ITEMS) else 5 if small else 3)
                )
                if not baseline:  # its baseline was not measured before the deadline
                    cells.append("n/a")
                    continue
                reference = statistics.median(r[metric] for r in baseline)
                cells.append(f"{statistics.median(values) / reference:.3f}")
            else:
                cells.append(_plain(values))
        lines.append("| " + " | ".join(cells) + " |")
    if unmeasured:
        lines += ["", f"Cut short at the deadline; not measured: {', '.join(unmeasured)}."]
    if suite.notes is not None and not unmeasured:
        medians = {
            name: {m: statistics.median(r[m] for r in runs) for m in metrics}
            for name, runs in results.items()
        }
        lines += ["", *suite.notes(medians)]
    return "\n".join(lines) + "\n"
