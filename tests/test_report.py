"""runner-report's choice of columns: the config values that really differ between runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from runner.cli.report import differing_keys
from runner.sweeps.job_dirs import run_config
from tests.helpers.cli import HANG, child_env


def write_run(root: Path, name: str, config: dict, resolved: bool = True) -> Path:
    run = root / name
    target = run / "config.yaml" if resolved else run / ".hydra" / "config.yaml"
    target.parent.mkdir(parents=True)
    target.write_text(yaml.safe_dump(config))
    return run


def test_differing_keys(tmp_path: Path) -> None:
    ddp = {"parallelism": {"name": "ddp", "bucket_cap_mb": 25.0}, "seed": 0, "nproc": 2}
    zero = {"parallelism": {"name": "zero2", "overlap_comm": False}, "seed": 0, "nproc": 2}
    other_seed = {**ddp, "seed": 1, "device": "cpu"}
    rejected = {"parallelism": {"name": "ddp"}, "seed": 0, "nproc": 2, "device": "auto"}
    runs = [
        write_run(tmp_path, "a", ddp),
        write_run(tmp_path, "b", zero),
        write_run(tmp_path, "c", {**other_seed, "device": "cpu"}),
        write_run(tmp_path, "d", rejected, resolved=False),  # a sweep job that never started
    ]
    configs = [run_config(run) for run in runs]
    # option-specific keys of a switched group are left out; `auto` of a rejected job is not
    # a difference; a key only one resolved run has is.
    assert differing_keys(runs, configs) == ["device", "parallelism.name", "seed"]


@pytest.mark.slow
def test_without_the_report_extra_it_names_the_extra(tmp_path: Path) -> None:
    """A machine without matplotlib or rich (they are the `report` extra, not core): one
    line naming the extra, exit 2, no traceback. rich is hidden behind a module that fails
    to import, first on the path."""
    hidden = tmp_path / "hidden" / "rich"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError(\"No module named 'rich'\")\n")
    run = write_run(tmp_path, "run", {"seed": 0})
    env = child_env()
    env["PYTHONPATH"] = f"{hidden.parent}:{env['PYTHONPATH']}"
    done = subprocess.run(
        [sys.executable, "-m", "runner.cli.report", str(run)],
        capture_output=True, text=True, env=env, timeout=HANG,
    )  # fmt: skip
    assert done.returncode == 2
    assert "pip install 'runner[report]'" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_watch_shows_a_sweep_as_it_runs(tmp_path: Path) -> None:
    """`--watch`: a job still running shows its latest values from metrics.jsonl; a job
    that starts later and one that ends show up at the next refresh; Ctrl-C ends it, exit 0."""
    import json
    import signal
    import threading
    import time

    sweep = tmp_path / "sweep"
    first = write_run(sweep, "0", {"seed": 0, "sweep": {"metric": "val/loss"}})
    (first / "metrics.jsonl").write_text(json.dumps({"step": 20, "val/loss": 0.75}) + "\n")
    watch = subprocess.Popen(
        [sys.executable, "-m", "runner.cli.report", "--watch", "0.2", str(sweep)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(),
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(watch.stdout), daemon=True)
    reader.start()

    def wait_for(*texts: str) -> None:  # the watch never ends by itself: no communicate()
        deadline = time.monotonic() + HANG
        while not all(any(text in line for line in list(lines)) for text in texts):
            assert watch.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.05)

    try:
        wait_for("running", "0.75")
        write_run(sweep, "1", {"seed": 1, "sweep": {"metric": "val/loss"}})  # a job starts
        (first / "summary.json").write_text(
            json.dumps({"status": "pruned", "steps": 20, "final": {"val/loss": 0.75}})
        )
        wait_for("pruned", "seed")  # seed: the column the two runs differ in
    finally:
        watch.send_signal(signal.SIGINT)
        watch.wait(timeout=HANG)  # stdout is the reader's
    err = watch.stderr.read()
    assert watch.returncode == 0, err
    assert (sweep / "report.png").is_file() and "Traceback" not in err
