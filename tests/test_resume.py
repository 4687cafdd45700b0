"""A killed rank costs a restart, never the run; an interrupted run resumes exactly."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from tests.conftest import FAST, start_runner, wait_until

pytestmark = pytest.mark.slow
ARGS = [*FAST, "max_epochs=null", "max_steps=12", "log_interval=2", "checkpoint.interval=2"]


def same_weights(a: Path, b: Path) -> bool:
    x = torch.load(a / "model.pt", weights_only=True)
    y = torch.load(b / "model.pt", weights_only=True)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.parametrize("parallelism", ["ddp", "zero2"])
def test_killed_rank_restarts_and_ends_bit_for_bit(cli, parallelism: str) -> None:
    reference = cli(*ARGS, f"parallelism={parallelism}", name="reference")
    killed = cli(
        *ARGS,
        f"parallelism={parallelism}",
        "max_restarts=1",
        "chaos.kill_rank=1",
        "chaos.at_step=5",
        name="killed",
    )
    assert reference.returncode == 0, reference.output
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


def test_sigterm_then_resume_auto_ends_bit_for_bit(cli, tmp_path: Path) -> None:
    args = [*FAST, "max_epochs=null", "max_steps=300", "log_interval=10", "checkpoint.interval=40"]
    reference = cli(*args, name="reference")
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
    assert same_weights(reference.run_dir, run_dir)
    summary = resumed.summary()
    assert summary["status"] == "completed" and summary["resumed_from"] % 40 == 0
    assert summary["resumed_from"] >= 40
    assert [h["status"] for h in summary["history"]] == ["interrupted"]
    steps = [m["step"] for m in resumed.metrics()]
    assert steps == sorted(set(steps)), "a resumed run must not repeat metrics lines"


def test_resume_skips_a_damaged_checkpoint(cli) -> None:
    first = cli(*ARGS, name="run")
    assert first.returncode == 0, first.output
    checkpoints = first.run_dir / "checkpoints"
    newest = sorted(checkpoints.glob("step_*"))[-1]
    with open(newest / "state.pt", "r+b") as f:  # a truncated file, e.g. a full disk
        f.truncate(100)
    again = cli(*ARGS, "resume=auto", "max_steps=14", name="run")
    assert again.returncode == 0, again.output
    assert again.summary()["resumed_from"] == 10  # the previous good one (keep=2: 10, 12)


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


def test_ddp_checkpoint_resumes_at_another_world_size(cli) -> None:
    """2 ranks train 6 steps; 1 rank with grad_accum=2 continues from their checkpoint to 12.

    Same samples in the same order, so the result matches 12 steps on 2 ranks up to float
    summation order; a wrong sample position would be off by orders of magnitude more.
    """
    args = [*ARGS, "scheduler=constant"]
    reference = cli(*args, name="reference")
    first = cli(*args, "max_steps=6", name="first")
    assert first.returncode == 0, first.output
    second = cli(*args, "nproc=1", "grad_accum=2", f"resume={first.run_dir}", name="second")
    assert second.returncode == 0, second.output
    assert second.summary()["resumed_from"] == 6 and second.summary()["world_size"] == 1
    assert max_relative_difference(second.run_dir, reference.run_dir) < 1e-5
    expected = {m["step"]: m["train/loss"] for m in reference.metrics()}
    for record in second.metrics():
        assert record["step"] > 6
        assert record["train/loss"] == pytest.approx(expected[record["step"]], rel=1e-5)
