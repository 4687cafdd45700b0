"""`sync_debug=warn|error`: torch's CUDA sync debug mode on the steps that log nothing.

On a GPU the host must not wait for the device on a step that logs nothing (no `.item()`,
`bool(tensor)` or `.cpu()`, no copy from pageable memory): the GPU then runs a step ahead
while the host queues the next. torch can report every such wait
(`torch.cuda.set_sync_debug_mode`); this turns it on for exactly those steps, from the
third of each start on, and off on steps that log, evaluate or save, where reading the
device is the point. The first two settle: the first allocates, autotunes and records the
order DDP's gradients arrive in; DDP rebuilds its buckets in the second's forward pass,
which copies the new bucket indices back to the host once. `error` raises at the line
that waits, `warn` prints it.

What waits by design, and so cannot run under `error`: ZeRO (DeepSpeed reads whether the
gradient norm is finite every step), fp16 under ddp and fsdp (GradScaler reads its overflow
flag), `nonfinite=skip` (one read a step) and `grad_accum=auto` (one a microbatch). On a
CPU there is nothing to wait for: the option does nothing there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

SETTLING_STEPS = 2  # of each start, never armed (see above)


class SyncDebug:
    def __init__(
        self,
        mode: Literal["warn", "error"] | None,
        device: str,
        set_mode: Callable[[str], None] | None = None,
    ):
        """`set_mode`: torch.cuda.set_sync_debug_mode unless given."""
        self.mode = mode if torch.device(device).type == "cuda" else None
        self.set_mode = set_mode or torch.cuda.set_sync_debug_mode
        self.steps = 0

    def step(self, quiet: bool) -> None:
        """At the start of a step: `quiet`, it logs, evaluates and saves nothing."""
        if self.mode is None:
            return
        self.steps += 1
        armed = quiet and self.steps > SETTLING_STEPS
        self.set_mode(self.mode if armed else "default")

    def off(self) -> None:
        """Leaving the steps (an evaluation, a stop, the end)."""
        if self.mode is not None:
            self.set_mode("default")
