"""The ATen ops a training step dispatches, counted step by step with a TorchDispatchMode (on
the training thread): what runner's loop launches beside the model's own work, held against
the loop a user writes by hand.

`callbacks=[{_target_: tests.helpers.op_counts.OpCounter}]` counts a runner run's (the step
read off the training loop's frame, as tests.helpers.host_syncs does) and writes
`op_counts.json` into the run directory at the end.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from tests.helpers.host_syncs import _training_step


class OpCounts(TorchDispatchMode):
    """Counts every dispatched ATen op under the step `step_of()` says (None: not counted)."""

    def __init__(self, step_of: Callable[[], int | None]):
        super().__init__()
        self.step_of = step_of
        self.counts: Counter[int] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        step = self.step_of()
        if step is not None:
            self.counts[step] += 1
        return func(*args, **(kwargs or {}))


class OpCounter:
    """On rank 0 (a callback): every step's op count, into op_counts.json."""

    def on_fit_start(self, run: Any) -> None:
        self.mode = OpCounts(lambda: _training_step(sys._getframe(1)))
        self.mode.__enter__()  # for the rest of the run, on this (the training) thread

    def on_fit_end(self, run: Any, summary: dict[str, Any]) -> None:
        self.mode.__exit__(None, None, None)
        (Path(run.run_dir) / "op_counts.json").write_text(json.dumps(self.mode.counts))


def counted(run_dir: Path) -> dict[int, int]:
    return {int(k): v for k, v in json.loads((run_dir / "op_counts.json").read_text()).items()}
