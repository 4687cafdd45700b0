"""What a tracker wrote, read back: TensorBoard's scalars."""

from __future__ import annotations

from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    reader = EventAccumulator(str(directory))
    reader.Reload()
    return {
        tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]
    }
