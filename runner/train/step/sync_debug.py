"""`sync_debug=warn|error`: torch's CUDA sync debug mode on the steps that log nothing.

On a GPU the host must not wait for the device on a step that logs nothing (no `.item()`,
`bool(tensor)` or `.cpu()`, no copy from pageable memory): the GPU then runs a step ahead
while the host queues the next. torch can report every such wait
(`torch.cuda.set_sync_debug_mode`); this turns it on for exactly those steps, from the
second one on (the first builds DDP's buckets, allocates, autotunes), and off on steps that
log, evaluate or save, where reading the device is the point. `error` raises at the line
that waits, `warn` prints it.

What waits by design, and so cannot run under `error`: ZeRO (DeepSpeed reads whether the
gradient norm is finite every step), fp16 under ddp and fsdp (GradScaler reads its overflow
flag), `nonfinite=skip` (one read a step) and `grad_accum=auto` (one a microbatch). On a
CPU there is nothing to wait for: the option does nothing there.
"""

from __future__ import annotations

from typing import Literal

import torch


class SyncDebug:
    def __init__(self, mode: Literal["warn", "error"] | None, device: str):
        self.mode = mode if torch.device(device).type == "cuda" else None
        self.first = True

    def step(self, quiet: bool) -> None:
        """At the start of a step: `quiet`, it logs, evaluates and saves nothing."""
        if self.mode is None:
            return
        armed = quiet and not self.first
        self.first = False
        torch.cuda.set_sync_debug_mode(self.mode if armed else "default")

    def off(self) -> None:
        """Leaving the steps (an evaluation, a stop, the end)."""
        if self.mode is not None:
            torch.cuda.set_sync_debug_mode("default")
