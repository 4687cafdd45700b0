"""Every file a run or sweep writes and later reads, truncated, corrupted at the same size, and
deleted: each is found, named and worked around (falls back, rebuilt), or refused naming the
file; none is trained past. docs/faults.md's damage table is this test's table.

The matrix damages a copy of one finished sweep (a job with checkpoints of steps 2 and 4, its
tables, a study, a token cache, tracker runs) and runs the code that reads that file first
when the user goes on: the parent's choice of the checkpoint to resume from, the sweep's
look at a job's summary, `runner rerun`'s read of config.yaml, rank 0's read of
metrics.jsonl, the token cache's open, the study's rebuild, the tables' rewrite, the trackers'
run ids. The runs below it do the same through the `runner` command."""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from runner.rundir.files import RunDir
from tests.helpers.cli import FAST, REPO, run_cli, run_sweep

pytestmark = pytest.mark.slow
JOB = "0"
STEP4 = f"{JOB}/checkpoints/step_00000004"
FALLS_BACK, REBUILT, REFUSED, IGNORED = "falls back", "rebuilt", "refused", "ignored"


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished sweep of one job (checkpoints of steps 2 and 4), with a study, a token
    cache and the trackers' run ids beside it, as the runs that keep them leave them."""
    import optuna

    from runner.data.token_cache import open_cache
    from runner.data.tokenizing import ByteTokenizer
    from runner.rundir.tracker_runs import note_tracker_run
    from runner.sweeps.study import write_study_file

    tmp = tmp_path_factory.mktemp("finished")
    overrides = [*FAST, "nproc=1", "max_epochs=null", "max_steps=4", "checkpoint.interval=2"]
    proc, root = run_sweep(tmp, *overrides, "eval_interval=1000", "seed=1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    note_tracker_run(root / JOB, "mlflow", {"run_id": "0123abcd", "tracking_uri": "file:x"})
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    study.tell(study.ask({"x": optuna.distributions.UniformDistribution(0, 1)}), 0.5)
    write_study_file(root, study, "sweep")
    (tmp / "corpus").mkdir()
    for i in range(3):
        (tmp / "corpus" / f"doc{i}.txt").write_text(f"document {i}: " + "alpha beta " * 200)
    open_cache(tmp / "corpus", "*.txt", ByteTokenizer(), "text", str(root / "cache"))
    return root


def _cache_file(root: Path) -> Path:
    return next((root / "cache").glob("*/tokens.bin"))


# ------------------------------------------------------------------ what reads each file


@dataclasses.dataclass
class Read:
    outcome: str
    said: str  # what the reader said (its warnings, its refusal)


def _resume(root: Path, caplog) -> Read:
    """The parent's choice of the checkpoint `runner resume=auto` goes on from."""
    from runner.cli.resume_point import resume_problems
    from runner.spec import load_spec

    job = root / JOB
    spec = dataclasses.replace(load_spec(job), resume="auto")
    problems = resume_problems(spec, job)
    said = " ".join([*problems, caplog.text])
    if problems:
        return Read(REFUSED, said)
    from runner.rundir.checkpoints import newest_intact

    picked = newest_intact(job / "checkpoints").path
    return Read(IGNORED if picked and picked.name == "step_00000004" else FALLS_BACK, said)


def _summary(root: Path, caplog) -> Read:
    """A resumed launch sets the summary aside, and the sweep run again decides on the job."""
    from runner.rundir.summary import archive_previous
    from runner.sweeps.resume import RESUME, earlier_start

    job = root / JOB
    start = earlier_start(job, rerun_failed=False)
    archive_previous(RunDir(job))
    resumed = start.action == RESUME and not (job / "summary.json").exists()
    return Read(REBUILT if resumed else "kept as it ended", caplog.text)


def _config(root: Path, caplog, capsys) -> Read:
    """`runner rerun RUN_DIR` (a resumed launch writes config.yaml anew)."""
    from runner.cli.rerun import rerun_argv

    try:
        rerun_argv([str(root / JOB)], REPO / "conf")
    except SystemExit as exc:
        return Read(REFUSED if exc.code == 2 else f"exit {exc.code}", capsys.readouterr().err)
    return Read("read", caplog.text)


def _metrics(root: Path, caplog) -> Read:
    """Rank 0 going on after the checkpoint of step 4: the records it keeps."""
    from runner.train.records.metrics_file import MetricsLog

    metrics = MetricsLog(RunDir(root / JOB), enabled=True, keep_until=4)
    metrics.close()
    kept = [r["step"] for r in metrics.records]
    readable = all(isinstance(json.loads(line), dict) for line in _lines(root))
    return Read(FALLS_BACK if readable and kept == sorted(kept) else "unreadable", caplog.text)


def _lines(root: Path) -> list[str]:
    return (root / JOB / "metrics.jsonl").read_text().splitlines()


def _token_cache(root: Path, caplog) -> Read:
    from runner.data.token_cache import open_cache
    from runner.data.tokenizing import ByteTokenizer

    corpus = root.parent / "corpus"
    cache = open_cache(corpus, "*.txt", ByteTokenizer(), "text", str(root / "cache"))
    cache.verify()  # what it serves is whole
    return Read(REBUILT, caplog.text)


def _study(root: Path, caplog) -> Read:
    from runner.sweeps.study_sweep import kept_study

    _, problems = kept_study(root)
    return Read(REFUSED if problems else "kept", " ".join(problems))


def _tables(root: Path, caplog) -> Read:
    """Each job's end (and the sweep's) rewrites them from the jobs' directories."""
    from runner.sweeps.tables import write_sweep_table

    write_sweep_table(root)
    rows = list(csv.DictReader((root / "sweep.csv").read_text().splitlines()))
    whole = [(r["job"], r["status"]) for r in rows] == [("0", "completed")]
    whole &= "| 0 |  | completed | 4 |" in (root / "sweep.md").read_text()
    return Read(REBUILT if whole else "not rebuilt", caplog.text)


def _tracker_runs(root: Path, caplog) -> Read:
    """A resumed run's trackers look up the runs they logged to."""
    from runner.rundir.tracker_runs import read_tracker_run

    found = read_tracker_run(root / JOB, "mlflow")
    return Read(FALLS_BACK if found is None else "read", caplog.text)


# file: (path in the sweep, its reader, what each damage (truncated, corrupted, deleted) comes
# to; a capital letter: what the reader said names the file)
FILES: dict[str, tuple[str, Callable, str]] = {
    "checkpoint file (state.pt)": (f"{STEP4}/state.pt", _resume, "F F F"),
    "checkpoint manifest": (f"{STEP4}/MANIFEST.json", _resume, "F F F"),
    "checkpoint settings (checkpoint.json)": (f"{STEP4}/checkpoint.json", _resume, "F F F"),
    "latest": (f"{JOB}/checkpoints/latest", _resume, "i i i"),
    "summary.json": (f"{JOB}/summary.json", _summary, "B B b"),
    "config.yaml": (f"{JOB}/config.yaml", _config, "R R R"),
    "metrics.jsonl": (f"{JOB}/metrics.jsonl", _metrics, "f F f"),
    "token cache (tokens.bin)": ("cache", _token_cache, "B B B"),
    "study.json": ("study.json", _study, "R R R"),
    "sweep.csv": ("sweep.csv", _tables, "b b b"),
    "sweep.md": ("sweep.md", _tables, "b b b"),
    "tracker_runs.json": (f"{JOB}/tracker_runs.json", _tracker_runs, "F F f"),
}
OUTCOMES = {"f": FALLS_BACK, "b": REBUILT, "r": REFUSED, "i": IGNORED}
DAMAGES = ("truncated", "corrupted", "deleted")


def damage(path: Path, how: str) -> None:
    """Truncated to half; corrupted: the same size, bytes in its middle overwritten (as a bad
    disk or a stray write leaves it); deleted."""
    if how == "deleted":
        path.unlink()
        return
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
        return
    middle = len(data) // 2
    data[middle : middle + 4] = b"\xff\x00\xfe\x01"[: len(data) - middle]
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("name", list(FILES))
def test_a_damaged_file_is_named_and_worked_around_or_refused(
    tmp_path: Path, finished: Path, name: str, how: str, caplog, capsys
) -> None:
    relative, reader, expected = FILES[name]
    root = tmp_path / "sweep"
    shutil.copytree(finished, root, symlinks=True)
    (tmp_path / "corpus").symlink_to(finished.parent / "corpus")
    target = _cache_file(root) if relative == "cache" else root / relative
    damage(target, how)
    caplog.set_level(logging.WARNING, logger="runner")
    read = reader(root, caplog, capsys) if reader is _config else reader(root, caplog)
    letter = expected.split()[DAMAGES.index(how)]
    assert read.outcome == OUTCOMES[letter.lower()], read.said
    if letter.isupper():
        assert target.name in read.said, read.said


# ------------------------------------------------------------------ through the command


def _job_copy(finished: Path, tmp_path: Path) -> Path:
    job = tmp_path / "run"
    shutil.copytree(finished / JOB, job)
    return job


RESUME = [*FAST, "nproc=1", "max_epochs=null", "max_steps=6", "checkpoint.interval=2"]


def test_bytes_changed_in_the_latest_checkpoint_resume_from_the_one_before(
    tmp_path: Path, finished: Path
) -> None:
    """58fe533: the ranks started, then failed with `UnpicklingError: invalid load key` and a
    traceback naming no file."""
    job = _job_copy(finished, tmp_path)
    damage(job / "checkpoints" / "step_00000004" / "state.pt", "corrupted")
    result = run_cli(tmp_path, *RESUME, "eval_interval=1000", "resume=auto", name="run")
    assert result.returncode == 0, result.output
    assert (
        f"runner: checkpoint {job}/checkpoints/step_00000004 is damaged, skipped: state.pt does "
        "not hold the bytes written (its digest differs); resuming from step_00000002"
    ) in result.stderr
    summary = result.summary()
    assert (summary["status"], summary["resumed_from"], summary["steps"]) == ("completed", 2, 6)


def test_no_intact_checkpoint_is_refused_rather_than_trained_from_step_0(
    tmp_path: Path, finished: Path
) -> None:
    """58fe533: exit 0, training silently started again from step 0 (resumed_from: null)."""
    job = _job_copy(finished, tmp_path)
    before = (job / "summary.json").read_bytes(), (job / "logs" / "rank0.log").read_bytes()
    for state in job.glob("checkpoints/step_*/state.pt"):
        damage(state, "truncated")
    result = run_cli(tmp_path, *RESUME, "eval_interval=1000", "resume=auto", name="run")
    assert result.returncode == 2, result.output
    assert "resume=auto: no intact checkpoint to resume from" in result.stderr
    for step in ("step_00000002", "step_00000004"):
        assert f"{job}/checkpoints/{step} (state.pt has " in result.stderr
    assert "Traceback" not in result.output
    after = (job / "summary.json").read_bytes(), (job / "logs" / "rank0.log").read_bytes()
    assert after == before  # the finished run's, untouched: no rank started


def test_a_checkpoint_sealed_without_digests_that_cannot_be_read_is_named(
    tmp_path: Path, finished: Path
) -> None:
    """An older runner's checkpoint (sizes only) with bytes changed: rank 0 names the
    checkpoint it could not read, and no traceback reaches the terminal."""
    job = _job_copy(finished, tmp_path)
    for checkpoint in job.glob("checkpoints/step_*"):
        manifest = json.loads((checkpoint / "MANIFEST.json").read_text())
        manifest.pop("digests")
        (checkpoint / "MANIFEST.json").write_text(json.dumps(manifest))
    state = job / "checkpoints" / "step_00000004" / "state.pt"
    state.write_bytes(b"\x00" * 8 + state.read_bytes()[8:])  # its header: torch cannot read it
    result = run_cli(tmp_path, *RESUME, "eval_interval=1000", "resume=auto", name="run")
    assert result.returncode == 1, result.output
    assert (
        f"raised CheckpointReadError: checkpoint {job}/checkpoints/step_00000004 could not be "
        "read: " in result.stderr
    )
    assert "Traceback" not in result.stderr and "traceback" not in result.stderr
