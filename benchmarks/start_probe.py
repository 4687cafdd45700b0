"""A rank that only starts: torch, a gloo process group, a DDP model (which pulls in
torch._dynamo) and one all-reduce, then it writes when it got there to OUT_DIR/rank{R} and
ends. `python -m start_probe OUT_DIR`, or `ready(OUT_DIR)` as torch elastic's function entry
point (start_methods.py)."""

from __future__ import annotations

import sys
import time
from pathlib import Path


def ready(out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    model = DistributedDataParallel(torch.nn.Linear(8, 8))
    model(torch.zeros(2, 8)).sum().backward()  # the gradient all-reduce: every rank is up
    Path(out_dir, f"rank{dist.get_rank()}").write_text(repr(time.time()))
    dist.destroy_process_group()


if __name__ == "__main__":
    import os

    ready(sys.argv[1])
    # As runner's worker does: torch's C++ teardown at interpreter exit can abort
    # ("terminate called without an active exception"), which would fail the launch.
    sys.stdout.flush()
    os._exit(0)
