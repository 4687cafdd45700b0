"""Every command once in a pseudo-terminal, typed as the docs give it, with the progress bar
on (the other tests turn it off): from an activated venv and as `.venv/bin/runner`, and
Ctrl-C typed at the terminal while a run starts, while it trains and while a sweep's job
starts. (On 58fe533: a ZeRO run rebuilt DeepSpeed's op at each switch between the two,
for minutes, behind a bar stuck at 0; `runner eval` drew a `train 0/276` bar; two jobs side
by side drew their bars on one line; an early Ctrl-C printed a KeyboardInterrupt traceback.)"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.helpers.terminal import CTRL_C, command, type_in

pytestmark = pytest.mark.slow
TINY = ["model=mlp", "data=digits", "max_epochs=null", "eval_interval=1000"]
# about 100 MB of training state: a checkpoint (every 8 steps) takes a while to write
GPT_100MB = ["+recipe=gpt_text", "model.n_layer=2", "model.n_embd=512", "model.n_head=8"]
GPT_100MB += ["data.block_size=64", "global_batch_size=8", "eval_interval=null", "logger=[]"]
GPT_100MB += ["checkpoint.interval=8"]
BAR = re.compile(r"train:? +\d+%\|")  # tqdm's bar: `train:  40%|████      | 4/10`


def _clean(typed) -> None:
    assert "Traceback" not in typed.output and "KeyboardInterrupt" not in typed.output, typed.output


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A ZeRO-2 run typed from an activated venv, bar on: what the other commands read."""
    tmp = tmp_path_factory.mktemp("typed")
    run = tmp / "run"
    argv = [command("runner", activated=True), *TINY, "parallelism=zero2", "precision=bf16"]
    typed = type_in([*argv, "max_steps=10", f"hydra.run.dir={run}"], tmp, activated=True)
    assert typed.returncode == 0, typed.output
    _clean(typed)
    assert BAR.search(typed.output), typed.output  # the bar drew
    assert "building DeepSpeed" not in typed.output  # built once, at install
    assert "runner: completed 10 steps on 2 rank(s)" in typed.output
    return run


def test_eval_export_report_and_rerun_as_typed(tmp_path: Path, finished_run: Path) -> None:
    """The module's run read by each command, typed. The rerun is a ZeRO-2 run switched from
    the activated venv (the module's run, which built nothing either) to .venv/bin/runner:
    another ninja on the PATH, the op built at install kept."""
    evaluated = type_in(
        [command("runner", False), "eval", str(finished_run), f"hydra.run.dir={tmp_path / 'e'}"],
        tmp_path,
        activated=False,
    )
    assert evaluated.returncode == 0, evaluated.output
    _clean(evaluated)
    assert "evaluated (eval.json)" in evaluated.output
    assert not BAR.search(evaluated.output) and "train 0/" not in evaluated.output  # no steps

    exported = type_in(
        [command("runner", True), "export", str(finished_run), "--to", str(tmp_path / "hf")],
        tmp_path,
        activated=True,
    )
    assert exported.returncode == 0, exported.output
    _clean(exported)
    report = type_in([command("runner-report", True), str(finished_run)], tmp_path, True)
    assert report.returncode == 0 and "val/accuracy" in report.output, report.output
    _clean(report)
    again = type_in(
        [command("runner", False), "rerun", str(finished_run), "max_steps=2",
         f"hydra.run.dir={tmp_path / 'again'}"],
        tmp_path,
        activated=False,
    )  # fmt: skip
    assert again.returncode == 0, again.output
    _clean(again)
    assert "runner: completed 2 steps" in again.output
    assert "building DeepSpeed" not in again.output and BAR.search(again.output)


def test_prepare_manifest_and_config_as_typed(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the quick brown fox " * 500)
    prepared = type_in(
        [command("runner", True), "prepare", "data=text", f"data.root={corpus}",
         f"data.cache_dir={tmp_path / 'cache'}"],
        tmp_path,
        activated=True,
    )  # fmt: skip
    assert prepared.returncode == 0 and "token cache" in prepared.output, prepared.output
    _clean(prepared)
    manifest = type_in(
        [command("runner", False), "k8s-manifest", "--image", "img:1", "device=cuda"],
        tmp_path,
        activated=False,
    )
    assert manifest.returncode == 0 and "kind: TrainJob" in manifest.output, manifest.output
    config = type_in([command("runner", True), "--cfg", "job"], tmp_path, activated=True)
    assert config.returncode == 0 and "global_batch_size: 64" in config.output, config.output


@pytest.mark.sweeps
def test_two_jobs_side_by_side_share_no_line(tmp_path: Path) -> None:
    argv = [command("runner", True), "-m", "hydra/launcher=runner", *TINY, "nproc=1"]
    argv += ["max_steps=30", "log_interval=5", "seed=1,2", f"hydra.sweep.dir={tmp_path / 's'}"]
    typed = type_in(argv, tmp_path, activated=True)
    assert typed.returncode == 0, typed.output
    _clean(typed)
    assert not BAR.search(typed.output)  # the sweep's own lines say where each job is
    for line in typed.lines:  # one job's line each (a final line's "step 3.1 ms" is its own)
        one = line.count("runner:") <= 1 and line.count("run directory") <= 1
        assert one and len(re.findall(r"\d+ steps?\b(?! ?ms)", line)) <= 1, typed.lines
    assert "runner: sweep: 2 done, 0 running, 0 queued, 0 failed" in typed.output


@pytest.mark.parametrize(
    "when",
    ["composing", "planning", "starting", "training"],
)
def test_ctrl_c_typed_at_any_moment_ends_in_one_line(tmp_path: Path, when: str) -> None:
    """Ctrl-C while Hydra composes (the parent), while parallelism=auto's trial runs, while
    the launcher imports torch and before the first step, and in a step: exit 130, one line
    saying where the run stands. Stopped as it planned, the run leaves no directory (it had
    left one holding nothing of a run)."""
    started = time.monotonic()
    triggers = {
        # Python is up and runner's entry point has it (Hydra composes for seconds after;
        # at 0.5 s a busy machine's interpreter was still importing the entry module, whose
        # KeyboardInterrupt no handler can catch yet)
        "composing": lambda out: time.monotonic() - started > 1.5,
        "planning": lambda out: "plan trial 1" in out,
        "starting": lambda out: "rank(s) on this node" in out,
        "training": lambda out: bool(re.search(r"\| *[1-9]\d*/400", out)),
    }
    run = tmp_path / "r"
    argv = [command("runner", False), *TINY, "max_steps=400", f"hydra.run.dir={run}"]
    if when == "planning":  # a trial of 400 steps is running when the key lands
        argv += ["parallelism=auto", "plan.trials=1", "plan.trial_steps=400"]
    typed = type_in(
        argv, tmp_path, activated=False, keys=(triggers[when], CTRL_C * (1 + ("twice" in when)))
    )
    assert typed.returncode == 130, typed.output
    _clean(typed)
    said = [line for line in typed.lines if "interrupted by SIGINT" in line]
    assert len(said) == 1, typed.output
    if when == "planning":
        assert "before any rank started" in said[0] and not run.exists(), typed.output
    if when == "training":
        # the bar said step 1 for rank 0; another rank may still be in it when the key lands
        assert "after step" in said[0] or "had finished step 1" in said[0], said
    if (run / "summary.json").exists():
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] == "interrupted" and summary["signal"] == "SIGINT"


def test_ctrl_c_in_runner_plan_says_it_planned(tmp_path: Path) -> None:
    """`runner plan` starts no rank: interrupted, it says it was planning (it had said
    'before any rank started')."""
    started = time.monotonic()
    argv = [command("runner", False), "plan", "+recipe=gpt_text"]  # seconds of planning
    typed = type_in(
        argv, tmp_path, activated=False, keys=(lambda _: time.monotonic() - started > 1.5, CTRL_C)
    )
    assert typed.returncode == 130, typed.output
    assert "runner: interrupted by SIGINT while it planned" in typed.output, typed.output


def test_a_second_ctrl_c_as_the_first_unwinds_changes_nothing(tmp_path: Path) -> None:
    """SIGINT to the command's process group, then another 30-70 ms later (`timeout` adds its
    own to a terminal's; a user types it twice), at moments of start-up: each time exit 130
    and the one line. The second had killed the interpreter as it shut down (exit by the
    signal) in 6 of 12 such tries, or broken the unwinding into a traceback."""
    import subprocess

    from tests.helpers.cli import child_env

    argv = [command("runner", False), *TINY, "max_steps=100000", "nproc=1"]
    for k, delay in enumerate((0.5, 0.7, 0.9)):
        proc = subprocess.Popen(
            argv, cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.03 + 0.02 * k)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 130 and "Traceback" not in out, (delay, out)
        assert out.count("interrupted by SIGINT") == 1, out


def test_a_ctrl_c_delivered_twice_mid_run_says_where_the_run_stands(tmp_path: Path) -> None:
    """SIGINT to the command's group in a step, and again 30 ms later (one key press that
    `timeout` relays as well): the same request, not a second Ctrl-C that kills the
    launcher at once. The line and summary.json say the step every rank finished (a killed
    launcher's summary had said 'before every rank had finished step 1', steps 0, where no
    step had been logged yet)."""
    import subprocess

    from tests.helpers.cli import child_env

    run = tmp_path / "r"
    argv = [command("runner", False), *TINY, "max_steps=100000", "nproc=2", "log_interval=1000"]
    argv += ["checkpoint.interval=3", f"hydra.run.dir={run}"]
    proc = subprocess.Popen(
        argv, cwd=tmp_path, env=child_env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    deadline = time.monotonic() + 120
    while not (run / "checkpoints" / "latest").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.03)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in out, out
    said = re.search(r"interrupted by SIGINT after step (\d+);", out)
    assert said and int(said.group(1)) >= 3, out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == int(said.group(1)), summary


@pytest.mark.sweeps
def test_ctrl_c_while_a_sweeps_job_starts_stops_the_sweep(tmp_path: Path) -> None:
    """Hydra's default launcher, Ctrl-C as job 0's launcher starts: the job ends interrupted,
    job 1 never starts, exit 130, no traceback (58fe533: the agent's traceback)."""
    root = tmp_path / "s"
    # steps enough that the Ctrl-C a second after job 0's launch always lands in it (a job
    # that completed before it stays completed)
    argv = [command("runner", True), "-m", *TINY, "nproc=1", "max_steps=100000", "seed=1,2"]
    seen: list[float] = []

    def job_starting(out: str) -> bool:  # a second after Hydra launched job 0: its agent
        if "#0 :" in out and not seen:
            seen.append(time.monotonic())
        return bool(seen) and time.monotonic() - seen[0] > 1.0

    typed = type_in(
        [*argv, f"hydra.sweep.dir={root}"], tmp_path, activated=True, keys=(job_starting, CTRL_C)
    )
    assert typed.returncode == 130, typed.output
    _clean(typed)
    assert "SIGINT: the sweep stops" in typed.output or "interrupted by SIGINT" in typed.output
    assert not (root / "1").exists()
    if (root / "0" / "summary.json").exists():
        assert json.loads((root / "0" / "summary.json").read_text())["status"] == "interrupted"


def test_sigterm_in_a_checkpoint_write_keeps_the_one_before(tmp_path: Path) -> None:
    """SIGTERM (`kill`, a scheduler) while a checkpoint is being written: exit 143, one line,
    the half-written one gone, and resume=auto goes on from the one before."""
    from runner.rundir.checkpoints import CheckpointStore

    run = tmp_path / "r"
    argv = [command("runner", False), *GPT_100MB, "max_steps=4000", "checkpoint.keep=5"]
    argv += [f"hydra.run.dir={run}"]

    def writing(_out: str) -> bool:  # a later checkpoint's partial directory is there
        return (run / "checkpoints" / "step_00000008").is_dir() and any(
            (run / "checkpoints").glob(".partial-*")
        )

    typed = type_in(argv, tmp_path, activated=False, keys=(writing, signal.SIGTERM))
    assert typed.returncode == 143, typed.output
    _clean(typed)
    (said,) = [line for line in typed.lines if "interrupted by SIGTERM" in line]
    assert "resume=auto goes on from its checkpoint of step" in said
    assert not list((run / "checkpoints").glob(".partial-*"))
    assert CheckpointStore(run / "checkpoints", keep=1).latest() is not None


def test_sigterm_after_the_run_ended_leaves_it_completed(tmp_path: Path) -> None:
    """58fe533: `received SIGTERM; all ranks stopped`, then `completed`, exit 143."""
    run = tmp_path / "r"
    argv = [command("runner", True), *TINY, "max_steps=4", f"hydra.run.dir={run}"]
    argv += ["callbacks=[{_target_:tests.helpers.slow_end.SlowEnd}]"]
    typed = type_in(
        argv, tmp_path, activated=True, keys=(lambda _: (run / "ended").exists(), signal.SIGTERM)
    )
    assert typed.returncode == 0, typed.output
    _clean(typed)
    assert "all ranks stopped" not in typed.output
    assert json.loads((run / "summary.json").read_text())["status"] == "completed"
