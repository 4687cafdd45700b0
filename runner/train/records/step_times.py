"""Where a step's time goes: each log record's `time/...` keys, seconds per step over the
steps it covers, in parts that add up to the step's time:

- `time/data_s`: the loop waiting for the step's batches (the host's clock);
- `time/forward_backward_s`: every microbatch's forward and backward pass (and the gradient
  reductions they overlap: DDP's buckets, FSDP's reduce-scatters, a pipeline's sends);
- `time/grad_sync_s`: what stands between the last backward and the optimizer: the
  gradients' exposed reduction (forced_sync, ZeRO), unscaling, the norm and clipping;
- `time/optimizer_s`: the optimizer's step (and zeroing the gradients);
- `time/host_s`: the rest of the step's time: the loop's own work (logging, the records), on
  a GPU also the device waiting for the host;
- `time/step_s`: the step's training time (evaluations and checkpoints left out).

On a CPU the parts are the host's clock. On a GPU they are CUDA events recorded in the
stream at the parts' ends, read only once the record's reduction has waited for the device
anyway: no step that logs nothing waits for one.
"""

from __future__ import annotations

import time
from typing import Any

import torch

PARTS = ("forward_backward", "grad_sync", "optimizer")  # timed in the step; data: the loop's


class StepTimes:
    def __init__(self, device: str):
        self.cuda = torch.device(device).type == "cuda"
        self._laps: list[tuple[str, Any, Any]] = []  # (part, start, end) since the last take

    def start(self) -> Any:
        """The start of a step's timed parts: a mark to lap from."""
        return self._mark()

    def lap(self, part: str, since: Any) -> Any:
        """`part` ran from `since` to now; returns now, the next part's start."""
        now = self._mark()
        self._laps.append((part, since, now))
        return now

    def take(self) -> list[tuple[str, Any, Any]]:
        """The laps since the last take (a record's), to be read when `seconds` may."""
        laps, self._laps = self._laps, []
        return laps

    def seconds(self, laps: list[tuple[str, Any, Any]]) -> dict[str, float]:
        """Each part's seconds over `laps` (CUDA: call once the device has done them)."""
        total = dict.fromkeys(PARTS, 0.0)
        for part, start, end in laps:
            if self.cuda:
                total[part] += start.elapsed_time(end) / 1000.0
            else:
                total[part] += end - start
        return total

    def _mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event


def time_fields(parts: dict[str, float], data_s: float, elapsed: float, steps: int) -> dict:
    """A record's `time/...` keys: seconds per step over its `steps` (`elapsed` training
    seconds, `data_s` of them waiting for batches); the host's share is the rest."""
    steps = max(1, steps)
    fields = {f"time/{part}_s": seconds / steps for part, seconds in parts.items()}
    fields["time/data_s"] = data_s / steps
    fields["time/step_s"] = elapsed / steps
    timed = sum(fields[f"time/{part}_s"] for part in (*PARTS, "data"))
    fields["time/host_s"] = max(0.0, fields["time/step_s"] - timed)
    return fields
