"""Callbacks: a user's hooks, called at fit start, each record, each evaluation, each
checkpoint and fit end, on the ranks asked for, without changing the training numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.callbacks import Callback, hook_problems
from tests.helpers.cli import FAST
from tests.helpers.refusals import refusal

RECORDER = '''
import json, os
from pathlib import Path


class Recorder:
    """Writes each hook it sees to hooks-rank<R>.jsonl, and reads the model as it goes."""

    def __init__(self, tag: str = "x"):
        self.tag = tag

    def _write(self, run, hook, value):
        norm = sum(float(p.detach().float().norm()) for p in run.model.parameters())
        line = {"hook": hook, "step": run.step, "rank": run.rank, "tag": self.tag,
                "value": value, "norm": norm}
        with open(Path(os.environ["HOOKS_DIR"]) / f"hooks-rank{run.rank}.jsonl", "a") as f:
            f.write(json.dumps(line, default=str) + "\\n")

    def on_fit_start(self, run):
        self._write(run, "on_fit_start", run.config["max_steps"])

    def on_step_end(self, run, record):
        self._write(run, "on_step_end", record)

    def on_eval_end(self, run, metrics):
        self._write(run, "on_eval_end", metrics)

    def on_checkpoint_saved(self, run, path):
        self._write(run, "on_checkpoint_saved", str(path))

    def on_fit_end(self, run, summary):
        self._write(run, "on_fit_end", summary.get("status"))


class Boom:
    def on_step_end(self, run, record):
        if record["step"] >= 2:
            raise ValueError("boom at step %d" % record["step"])


class Misnamed:
    def on_train_end(self, run, summary):
        pass

    def on_step_ends(self, run, record):
        pass
'''

ARGS = [*FAST, "max_steps=4", "log_interval=1", "eval_interval=2", "checkpoint.interval=2"]


def hooks(directory: Path, rank: int) -> list[dict]:
    path = directory / f"hooks-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_hooks_are_called_on_the_ranks_asked_for_and_change_nothing(
    tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mycallbacks.py").write_text(RECORDER)
    monkeypatch.setenv("HOOKS_DIR", str(tmp_path))
    plain = cli(*ARGS, name="plain")
    assert plain.returncode == 0, plain.output
    result = cli(*ARGS, "callbacks=[{_target_:mycallbacks.Recorder,tag:t,ranks:all}]")
    assert result.returncode == 0, result.output

    losses = [(m["step"], m["train/loss"]) for m in result.metrics()]
    assert losses == [(m["step"], m["train/loss"]) for m in plain.metrics()]  # bit for bit
    for rank in (0, 1):
        seen = hooks(tmp_path, rank)
        names = [h["hook"] for h in seen]
        assert names[0] == "on_fit_start" and names[-1] == "on_fit_end", names
        assert {h["rank"] for h in seen} == {rank} and {h["tag"] for h in seen} == {"t"}
        steps = [h["value"] for h in seen if h["hook"] == "on_step_end"]
        assert [(r["step"], r["train/loss"]) for r in steps] == losses  # the records
        evals = [h["value"] for h in seen if h["hook"] == "on_eval_end"]
        assert [e["step"] for e in evals] == [2, 4] and all("val/loss" in e for e in evals)
        saved = [h for h in seen if h["hook"] == "on_checkpoint_saved"]
        assert [h["step"] for h in saved] == [2, 4]
        assert all(Path(h["value"]).is_dir() for h in saved)
    assert hooks(tmp_path, 0)[-1]["value"] == "completed"
    config = (result.run_dir / "config.yaml").read_text()
    assert "mycallbacks.Recorder" in config


@pytest.mark.slow
def test_a_raising_callback_is_named_with_its_hook_and_rank(tmp_path: Path, cli) -> None:
    (tmp_path / "mycallbacks.py").write_text(RECORDER)
    result = cli(*ARGS, "callbacks=[{_target_:mycallbacks.Boom}]")
    assert result.returncode != 0
    assert (
        "callbacks[0] (mycallbacks.Boom) raised in on_step_end on rank 0: "
        "ValueError: boom at step 2" in result.output
    ), result.output


def test_misnamed_hooks_are_refused_before_launch(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "mycallbacks.py").write_text(RECORDER)
    monkeypatch.chdir(tmp_path)  # the user's module, where runner was started
    found = refusal(*ARGS, "callbacks=[{_target_:mycallbacks.Misnamed},{_target_:nopkg.X}]")
    for line in (
        "callbacks[0]: Misnamed.on_step_ends is not a hook runner calls; did you mean on_step_end?",
        "callbacks[0]: Misnamed.on_train_end is not a hook runner calls; did you mean on_fit_end?",
        "callbacks[1]._target_=nopkg.X: no module named 'nopkg'",
    ):
        assert line in found, found


def test_hook_problems_of_a_class() -> None:
    class Fine(Callback):
        def on_eval_end(self, run, metrics):  # type: ignore[no-untyped-def]
            pass

    class Empty(Callback):
        pass

    assert hook_problems("callbacks[0]", Fine) == []
    assert hook_problems("callbacks[0]", Empty) == [
        "callbacks[0]: Empty has none of the hooks (on_fit_start, on_step_end, on_eval_end, "
        "on_checkpoint_saved, on_fit_end)"
    ]
