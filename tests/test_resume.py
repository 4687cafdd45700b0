"""A killed rank costs a restart, never the run; an interrupted run resumes exactly."""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pytest
import torch

from tests.conftest import FAST, ZERO2_OFFLOAD, CliResult, run_cli, start_runner, wait_until
from tests.conftest import RESTARTABLE as ARGS

pytestmark = pytest.mark.slow


def same_weights(a: Path, b: Path) -> bool:
    x = torch.load(a / "model.pt", weights_only=True)
    y = torch.load(b / "model.pt", weights_only=True)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory) -> CliResult:
    """One uninterrupted 2-rank ddp run that keeps every checkpoint: this module's yardstick."""
    result = run_cli(tmp_path_factory.mktemp("ddp"), *ARGS, "checkpoint.keep=6", name="reference")
    assert result.returncode == 0, result.output
    return result


@pytest.mark.parametrize("parallelism", ["ddp", "zero2"])
def test_killed_rank_restarts_and_ends_bit_for_bit(cli, request, parallelism: str) -> None:
    if parallelism == "ddp":
        reference, engine = request.getfixturevalue("ddp_reference"), ["parallelism=ddp"]
    else:  # the run tests/test_run.py checks for its optimizer state, offloaded to the CPU
        reference, engine = request.getfixturevalue("zero2_offload_run"), list(ZERO2_OFFLOAD)
    killed = cli(*ARGS, *engine, "max_restarts=1", "chaos.kill_rank=1", "chaos.at_step=5")
    assert killed.returncode == 0, killed.output
    assert same_weights(reference.run_dir, killed.run_dir)
    summary = killed.summary()
    assert (summary["status"], summary["restarts"], summary["resumed_from"]) == ("completed", 1, 4)
    assert summary["attempts"] == [
        {"attempt": 0, "resumed_from": None},
        {"attempt": 1, "resumed_from": 4},
    ]
    assert [m["train/loss"] for m in killed.metrics()] == [
        m["train/loss"] for m in reference.metrics()
    ]
    log = (killed.run_dir / "logs" / "rank1.log").read_text()
    assert "rank 1 attempt 0" in log and "rank 1 attempt 1" in log  # both attempts kept
    if parallelism == "zero2":  # DeepSpeed's own layout, so its tools work on it
        assert (killed.run_dir / "checkpoints" / "step_00000012" / "zero_to_fp32.py").is_file()


def test_sigterm_then_resume_auto_ends_bit_for_bit(cli, tmp_path: Path, default_run) -> None:
    args = ["progress_bar=false", "checkpoint.interval=40"]  # the defaults: 276 steps
    run_dir = tmp_path / "interrupted"
    proc = start_runner(tmp_path, run_dir, *args)
    wait_until(proc, (run_dir / "checkpoints" / "latest").exists)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM
    first = json.loads((run_dir / "summary.json").read_text())
    assert first["status"] == "interrupted"

    resumed = cli(*args, "resume=auto", name="interrupted")
    assert resumed.returncode == 0, resumed.output
    assert same_weights(default_run.run_dir, run_dir)
    summary = resumed.summary()
    assert summary["status"] == "completed" and summary["resumed_from"] % 40 == 0
    assert summary["resumed_from"] >= 40
    assert [h["status"] for h in summary["history"]] == ["interrupted"]
    steps = [m["step"] for m in resumed.metrics()]
    assert steps == sorted(set(steps)), "a resumed run must not repeat metrics lines"


def test_resume_skips_a_damaged_checkpoint(cli, tmp_path: Path, ddp_reference) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(ddp_reference.run_dir, run_dir)
    newest = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    with open(newest / "state.pt", "r+b") as f:  # a truncated file, e.g. a full disk
        f.truncate(100)
    again = cli(*ARGS, "resume=auto", "max_steps=14", name="run")
    assert again.returncode == 0, again.output
    assert again.summary()["resumed_from"] == 10  # the previous good one


def test_resume_path_without_checkpoint_is_rejected(cli, tmp_path: Path) -> None:
    empty = tmp_path / "empty_run"
    empty.mkdir()
    result = cli(*FAST, f"resume={empty}")
    assert result.returncode == 2
    assert f"resume='{empty}': holds no complete checkpoint" in result.stderr


def max_relative_difference(a: Path, b: Path) -> float:
    x = torch.load(a / "model.pt", weights_only=True)
    y = torch.load(b / "model.pt", weights_only=True)
    return max(((x[k] - y[k]).norm() / y[k].norm()).item() for k in y)


def test_ddp_checkpoint_resumes_at_another_world_size(cli, ddp_reference) -> None:
    """1 rank with grad_accum=2 continues the 2-rank reference from its step-6 checkpoint.

    Same samples in the same order, so the result matches the reference's 12 steps up to
    float summation order; a wrong sample position would be off by orders of magnitude more.
    """
    checkpoint = ddp_reference.run_dir / "checkpoints" / "step_00000006"
    second = cli(*ARGS, "nproc=1", "grad_accum=2", f"resume={checkpoint}", name="second")
    assert second.returncode == 0, second.output
    assert second.summary()["resumed_from"] == 6 and second.summary()["world_size"] == 1
    assert max_relative_difference(second.run_dir, ddp_reference.run_dir) < 1e-5
    expected = {m["step"]: m["train/loss"] for m in ddp_reference.metrics()}
    for record in second.metrics():
        assert record["step"] > 6
        assert record["train/loss"] == pytest.approx(expected[record["step"]], rel=1e-5)


def test_fsdp_restarts_bit_for_bit_and_resumes_at_another_world_size(cli) -> None:
    """DCP checkpoints: a killed rank's restart ends bit for bit; 2 ranks' checkpoint
    continues on 1 rank (grad_accum 2, the same global batch) to the same weights."""
    fsdp = [*ARGS, "parallelism=fsdp"]
    reference = cli(*fsdp, "checkpoint.keep=6", name="reference")
    assert reference.returncode == 0, reference.output
    assert (reference.run_dir / "checkpoints" / "step_00000006" / "dcp").is_dir()
    killed = cli(*fsdp, "max_restarts=1", "chaos.kill_rank=1", "chaos.at_step=5", name="killed")
    assert killed.returncode == 0, killed.output
    assert same_weights(reference.run_dir, killed.run_dir)
    assert killed.summary()["resumed_from"] == 4

    step6 = reference.run_dir / "checkpoints" / "step_00000006"
    one = cli(*fsdp, "nproc=1", "grad_accum=2", f"resume={step6}", name="one_rank")
    assert one.returncode == 0, one.output
    assert one.summary()["resumed_from"] == 6
    x = torch.load(reference.run_dir / "model.pt", weights_only=True)
    y = torch.load(one.run_dir / "model.pt", weights_only=True)
    assert max(((x[k] - y[k]).norm() / x[k].norm()).item() for k in x) <= 1e-5
