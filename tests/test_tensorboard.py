"""runner's hand-written event files read back with TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from runner.train.tensorboard import EventWriter, _crc32c


def scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    reader = EventAccumulator(str(directory))
    reader.Reload()
    return {
        tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]
    }


def test_crc32c_known_value() -> None:
    assert _crc32c(b"123456789") == 0xE3069283  # the standard CRC-32C check value


def test_scalars_read_back(tmp_path: Path) -> None:
    writer = EventWriter(tmp_path, [])
    writer.add({"step": 10, "epoch": 0.5, "train/loss": 2.25, "lr": 1e-3})
    writer.add({"step": 20, "train/loss": 1.5, "val/accuracy": 0.75, "note": "text"})
    writer.close()
    found = scalars(tmp_path)
    assert found["train/loss"] == [(10, 2.25), (20, 1.5)]
    assert found["val/accuracy"] == [(20, 0.75)]
    assert found["lr"][0][1] == pytest.approx(1e-3)
    assert "step" not in found and "note" not in found


def test_a_resumed_run_rewrites_its_history(tmp_path: Path) -> None:
    first = EventWriter(tmp_path, [])
    for step in (10, 20, 30):
        first.add({"step": step, "train/loss": float(step)})
    first.close()
    kept = [{"step": 10, "train/loss": 10.0}, {"step": 20, "train/loss": 20.0}]
    again = EventWriter(tmp_path, kept)  # resumed from step 20: step 30 is trained again
    again.add({"step": 30, "train/loss": 29.0})
    again.close()
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
    assert scalars(tmp_path)["train/loss"] == [(10, 10.0), (20, 20.0), (30, 29.0)]
