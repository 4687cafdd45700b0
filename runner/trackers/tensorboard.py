"""TensorBoard event files through torch.utils.tensorboard's SummaryWriter."""

from __future__ import annotations

from typing import Any

from runner.rundir.files import RunDir
from runner.spec.tracker_specs import TensorBoardTrackerSpec


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, spec: TensorBoardTrackerSpec, run_dir: RunDir, keep_until: int):
        self.spec, self.directory, self.keep_until = spec, run_dir.tensorboard, keep_until
        self.writer: Any = None

    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run trains the steps after keep_until again: purge_step makes TensorBoard
        # drop what an earlier attempt wrote from there on, so no step shows twice.
        purge = self.keep_until + 1 if self.keep_until else None
        self.writer = SummaryWriter(
            str(self.directory), purge_step=purge, flush_secs=self.spec.flush_secs
        )

    def log(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            step = record["step"]
            for key, value in record.items():
                if (
                    key != "step"
                    and isinstance(value, (int, float))
                    and not isinstance(value, bool)
                ):
                    self.writer.add_scalar(key, value, step)

    def close(self, outcome: dict[str, Any] | None = None) -> None:
        self.writer.close()
