"""Where runner's own code would make the host wait for a GPU, counted on a CPU rank.

On a GPU, reading a device tensor on the host (`.item()`, `.tolist()`, `bool()`, `int()`,
`float()`, `.cpu()`, `.numpy()`, printing it) waits for the device, and so does a copy from
pageable host memory to the device (`.to(device)` without `non_blocking`, `torch.tensor(...,
device=...)`). On a CPU none of these wait, so nothing shows them; this callback (on every
rank) notes each one that runner's code makes, through a TorchFunctionMode that sees every
tensor method call, with the optimizer step it happened in (read off the training loop's
frame). It writes `host_syncs_rank{R}.json` into the run directory at the end.

Only calls made by runner's own lines count: torch's and DeepSpeed's own reads (Adam's step
counter, a host tensor on a GPU too; DeepSpeed's overflow check) are the libraries', which a
plain script pays alike. On a CPU every tensor is a host tensor, so the reads runner makes of
tensors that stay on the host on a GPU too are named in `ON_THE_HOST`, each with why.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

import runner

RUNNER = str(Path(runner.__file__).parent)
TORCH = str(Path(torch.__file__).parent)
# torch's own Python wrappers of tensor methods (__format__, ...): look past them
WRAPPERS = (f"{TORCH}/_tensor.py", f"{TORCH}/overrides.py", f"{TORCH}/_tensor_str.py")
TRAINER = f"{RUNNER}/train/trainer.py"

READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__",
         "__format__", "__repr__", "__str__"}  # fmt: skip
MOVES = {"to", "cuda"}
# (module, function) -> why the tensors it reads are host tensors on a GPU as well (a copy
# to the device it makes still counts)
ON_THE_HOST = {
    ("train/step/loss_items.py", "_reduced"): "the loader's batch, counted before it moves",
    ("train/step/loss_items.py", "_per_sample"): "the loader's batch (a CPU tensor, checked)",
}
MADE_FROM_HOST = {"tensor", "as_tensor"}


class HostSyncs(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, Any]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if (
            name in READS
            or (name in MOVES and _to_device(args[1:], kwargs))
            or (name in MADE_FROM_HOST and kwargs.get("device") is not None)
        ):
            self._note(name)
        return func(*args, **kwargs)

    def _note(self, name: str) -> None:
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(WRAPPERS):
            frame = frame.f_back
        if frame is None or not frame.f_code.co_filename.startswith(RUNNER):
            return
        module = frame.f_code.co_filename[len(RUNNER) + 1 :]
        if name in READS and (module, frame.f_code.co_name) in ON_THE_HOST:
            return
        where = f"{module}:{frame.f_lineno} ({frame.f_code.co_name})"
        self.seen.append({"step": _training_step(frame), "call": name, "where": where})


def _to_device(args: tuple, kwargs: dict) -> bool:
    """Whether a `.to(...)`/`.cuda()` call names a device and may wait (no non_blocking)."""
    if kwargs.get("non_blocking") or (len(args) > 1 and args[-1] is True):
        return False
    if kwargs.get("device") is not None:
        return True
    return any(isinstance(a, (str, torch.device, int)) and not isinstance(a, bool) for a in args)


def _training_step(frame: Any) -> int | None:
    """The step the training loop is at (its `step`), None outside the loop."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_fit" and code.co_filename == TRAINER:
            return frame.f_locals.get("step")
        frame = frame.f_back
    return None


class HostSyncCounter:
    """`callbacks=[{_target_: tests.helpers.host_syncs.HostSyncCounter, ranks: all}]`."""

    def on_fit_start(self, run: Any) -> None:
        self.mode = HostSyncs()
        self.mode.__enter__()  # for the rest of the process: every step, every hook after

    def on_fit_end(self, run: Any, summary: dict[str, Any]) -> None:
        path = Path(run.run_dir) / f"host_syncs_rank{run.rank}.json"
        path.write_text(json.dumps(self.mode.seen))


def recorded(run_dir: Path, rank: int) -> list[dict[str, Any]]:
    return json.loads((run_dir / f"host_syncs_rank{rank}.json").read_text())
