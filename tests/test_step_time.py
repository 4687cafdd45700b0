"""Where a step's time goes: each record's `time/...` parts (they add up to the step's time),
on the final line and in runner-report; `profile.steps` traces of chosen steps (Perfetto,
TensorBoard) in the run directory; what cannot be profiled refused before launch."""

from __future__ import annotations

import json

import pytest

from runner.train.records.step_times import PARTS, time_fields
from runner.train.records.traces import step_runs
from tests.helpers.cli import FAST
from tests.helpers.config import compose_config


def test_runs_of_steps_are_one_trace_each() -> None:
    assert step_runs((9, 3, 4, 5, 4)) == [(3, 5), (9, 9)]
    assert step_runs(()) == []


def test_the_parts_add_up_to_the_step() -> None:
    parts = {"forward_backward": 0.6, "grad_sync": 0.1, "optimizer": 0.2}
    fields = time_fields(parts, data_s=0.4, elapsed=2.0, steps=2)
    assert fields["time/step_s"] == 1.0 and fields["time/data_s"] == 0.2
    assert fields["time/host_s"] == pytest.approx(1.0 - 0.2 - 0.45)
    total = sum(fields[f"time/{p}_s"] for p in (*PARTS, "data", "host"))
    assert total == pytest.approx(fields["time/step_s"])
    # measured parts longer than the step (a GPU's device times): the host's share is 0
    assert time_fields(parts, 0.0, elapsed=0.5, steps=1)["time/host_s"] == 0.0


@pytest.mark.parametrize(
    ("overrides", "problem"),
    [
        (["profile.steps=[0,3]"], "profile.steps=[0, 3]: [0] not a step this run takes"),
        (
            ["max_steps=10", "max_epochs=null", "profile.steps=[12]"],
            "profile.steps=[12]: [12] not a step this run takes; valid: optimizer steps from 1 "
            "(max_steps=10)",
        ),
        (["profile.ranks=[2]"], "profile.ranks=[2]: [2] not a rank of this run; valid: main, all"),
        (["profile.ranks=[]"], "profile.ranks=[]: no rank to trace on; valid: main, all"),
        (["profile.memory=true", "device=cpu"], "profile.memory=true: CUDA memory snapshots need"),
    ],
)
def test_what_cannot_be_profiled_is_refused(overrides: list[str], problem: str) -> None:
    from runner.spec import SpecError, resolve_spec

    with pytest.raises(SpecError) as refused:
        resolve_spec(compose_config(["model=mlp", "data=digits", *overrides]))
    assert any(problem in p for p in refused.value.problems), refused.value.problems


@pytest.mark.slow
def test_a_run_says_where_its_steps_time_went_and_traces_the_steps_asked(cli) -> None:
    run = cli(
        *FAST, "max_epochs=null", "max_steps=12", "log_interval=4", "nproc=2",
        "profile.steps=[3,4,9]", "profile.ranks=all",
    )  # fmt: skip
    assert run.returncode == 0, run.output
    for record in run.metrics():
        parts = [record[f"time/{p}_s"] for p in (*PARTS, "data", "host")]
        assert all(p >= 0 for p in parts) and sum(parts) == pytest.approx(record["time/step_s"])
    assert "| step " in run.output and " ms: data " in run.output  # the final line
    traces = sorted(p.name for p in (run.run_dir / "profile").iterdir())
    assert traces == [
        f"rank{r}.{s}.pt.trace.json" for r in (0, 1) for s in ("steps_3-4", "steps_9-9")
    ]
    events = json.loads((run.run_dir / "profile" / "rank1.steps_3-4.pt.trace.json").read_text())
    marks = [e["name"] for e in events["traceEvents"] if e.get("name", "").startswith("step ")]
    assert marks == ["step 3", "step 4"]
    assert any(e.get("name") == "aten::linear" for e in events["traceEvents"])

    from runner.cli.report import rows

    columns, table = rows([run.run_dir], run.run_dir.parent)
    assert {"step_ms", "fwd_bwd_ms", "optimizer_ms", "host_ms"} <= set(columns)
    assert table[0]["step_ms"] == pytest.approx(1000 * run.summary()["final"]["time/step_s"])


@pytest.mark.slow
def test_profile_keys_through_a_runs_life(cli) -> None:
    """A step beyond an epoch-limited run (which the config cannot know) is said, not
    traced; `runner eval` of a run traced on rank 1 evaluates at nproc=1 without tracing
    (the run's profile keys were its training's), and refuses profile.steps of its own."""
    run = cli(*FAST, "max_epochs=1", "nproc=2", "profile.steps=[2,100000]", "profile.ranks=[1]")
    assert run.returncode == 0, run.output
    steps = run.summary()["steps"]
    assert f"runner: profile.steps: [100000] beyond this run's {steps} steps: not traced" in (
        run.output
    )
    traced = [p.name for p in (run.run_dir / "profile").iterdir()]
    assert traced == ["rank1.steps_2-2.pt.trace.json"]
    evaluated = cli("eval", str(run.run_dir), "nproc=1", name="eval")
    assert evaluated.returncode == 0, evaluated.output
    assert not (evaluated.run_dir / "profile").exists()
    refused = cli("eval", str(run.run_dir), "nproc=1", "profile.steps=[1]", name="refused")
    assert refused.returncode == 2
    assert "profile.steps=[1]: runner eval takes no training step to trace" in refused.output


def test_on_a_gpu_the_parts_are_events_read_only_with_the_record(monkeypatch) -> None:
    """As StepTimes sees a GPU (torch.cuda.Event stood in for by one that notes its reads):
    a step records events and reads none; the record's reduction, which waited for the
    device anyway, reads them (reading an event early would make the host wait)."""
    import time

    import torch

    from runner.train.records.step_times import StepTimes

    reads: list[str] = []

    class Event:
        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing
            self.at = None

        def record(self) -> None:
            self.at = time.perf_counter()

        def elapsed_time(self, end: Event) -> float:
            reads.append("elapsed_time")
            return 1000.0 * (end.at - self.at)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    times = StepTimes("cuda")
    for _ in range(3):  # three quiet steps
        lap = times.start()
        lap = times.lap("forward_backward", lap)
        lap = times.lap("grad_sync", lap)
        times.lap("optimizer", lap)
    laps = times.take()
    assert reads == [] and all(isinstance(mark, Event) for _, a, b in laps for mark in (a, b))
    seconds = times.seconds(laps)
    assert reads == ["elapsed_time"] * 9 and set(seconds) == set(PARTS)
