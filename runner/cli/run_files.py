"""The parent's files in a run directory: those written before the agent starts
(config.yaml, env.json, logs/, Hydra's record without the secrets given literally), and the
removal of a directory whose run never started."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from runner.cli.command_line import COMMAND_LINE_ENV
from runner.cli.hydra_files import hydra_subdir
from runner.rundir.files import RunDir, environment_info, write_json
from runner.rundir.summary import archive_previous
from runner.rundir.tracker_runs import SWEEP_DIR_ENV
from runner.secrets import Secrets
from runner.spec import RunSpec, save_spec, slurm


def file_run(spec: RunSpec, secrets: Secrets, run_dir: RunDir, sweep_dir: Path | None) -> None:
    """The run directory before the agent starts: config.yaml, env.json, logs/, an earlier
    launch's summary set aside; a sweep's job tells rank 0's trackers its sweep."""
    save_spec(spec, run_dir.root, secrets)
    env = {"run_id": uuid.uuid4().hex, **environment(spec, secrets)}
    write_json(run_dir.env, {**env, "slurm_job": slurm.job_key(os.environ)})
    run_dir.logs.mkdir(parents=True, exist_ok=True)
    archive_previous(run_dir)  # resuming in an earlier run's directory keeps its story
    if sweep_dir is not None:  # MLflow groups the sweep's jobs under one parent run
        os.environ[SWEEP_DIR_ENV] = str(Path(sweep_dir).absolute())
    else:
        os.environ.pop(SWEEP_DIR_ENV, None)


def environment(spec: RunSpec, secrets: Secrets) -> dict[str, Any]:
    """env.json's facts, its command line (the `runner` command's, also in a launcher
    plugin's job process) without the secrets given on it."""
    env = environment_info(spec.code_dir)
    command_line = os.environ.get(COMMAND_LINE_ENV)
    env["argv"] = secrets.masked_argv(json.loads(command_line) if command_line else env["argv"])
    return env


def scrub_hydra_files(
    secrets: Secrets, run_dir: Path, sweep_dir: Path | None, node_rank: int
) -> None:
    """Hydra's own record of the run (.hydra/, a sweep's multirun.yaml) without the secret
    values given literally."""
    if not secrets.values:
        return
    files = [*run_dir.joinpath(hydra_subdir(node_rank)).glob("*.yaml")]
    if sweep_dir is not None:
        files.append(sweep_dir / "multirun.yaml")
    for path in files:
        if path.is_file():
            text = path.read_text()
            if secrets.scrub(text) != text:
                path.write_text(secrets.scrub(text))


def discard(run_dir: Path, hydra_files: frozenset[str] = frozenset({".hydra"})) -> None:
    """Remove the directory Hydra made for a run or sweep that never started (only Hydra's
    files in it)."""
    for node_dir in run_dir.glob("node*"):  # another node's Hydra files (hydra_files.hydra_subdir)
        if {p.name for p in node_dir.iterdir()} <= {".hydra"}:
            shutil.rmtree(node_dir, ignore_errors=True)
    leftovers = {p.name for p in run_dir.iterdir()} if run_dir.is_dir() else set()
    if leftovers <= hydra_files:
        shutil.rmtree(run_dir, ignore_errors=True)
        if run_dir.parent.resolve() == (Path.cwd() / "runs").resolve():
            with contextlib.suppress(OSError):
                run_dir.parent.rmdir()  # the default runs/ itself, if this was its only run


def discard_rejected(run_dir: RunDir) -> None:
    """A launch the agent rejected before any rank started: remove what it wrote, and the
    directory itself when it held nothing before (a resumed run keeps its directory)."""
    earlier = (run_dir.checkpoints, run_dir.metrics, run_dir.logs / "previous_summary.json")
    if any(p.exists() for p in earlier):
        return
    for path in (run_dir.config, run_dir.env, run_dir.summary):
        path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        run_dir.logs.rmdir()  # empty: no rank wrote a log
    discard(run_dir.root)
