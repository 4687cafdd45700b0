"""The options of what runs on the device and how it is measured: torch.compile's, the peak
that model FLOPs utilisation is measured against, and the profiler's."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from runner.spec.bounds import bound as _bound


def _typed(value: object) -> str:
    """A value as the command line takes it (true, null, inductor)."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    return str(value)


@dataclass(frozen=True)
class CompileSpec:
    """torch.compile. `per_block`: compile each block of the model's blocks list on its own
    (after activation checkpointing, before FSDP shards it); null = when the model has
    one. Otherwise the whole model is compiled (under DDP with its graph-break optimizer)."""

    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = (
        "default"
    )
    backend: Literal["inductor", "aot_eager", "eager"] = "inductor"
    per_block: bool | None = None
    fullgraph: bool = False

    @property
    def captures_graphs(self) -> bool:
        """Whether inductor captures CUDA graphs in this mode (reduce-overhead and
        max-autotune do; max-autotune-no-cudagraphs does not)."""
        return self.backend == "inductor" and self.mode in ("reduce-overhead", "max-autotune")

    def typed(self, **changes: Any) -> str:
        """The override that gives these options with `changes`, as typed on the command
        line: `compile=true`, or a mapping of what differs from the defaults."""
        changed = dataclasses.replace(self, **changes)
        given = {
            f.name: getattr(changed, f.name)
            for f in dataclasses.fields(changed)
            if getattr(changed, f.name) != f.default
        }
        if not given:
            return "compile=true"
        shown = (f"{k}:{_typed(v)}" for k, v in given.items())
        return "compile={" + ",".join(shown) + "}"


@dataclass(frozen=True)
class MfuSpec:
    """Model FLOPs utilisation's peak: `peak_tflops` of one device (any device, CPU too),
    else the table of GPUs (runner.hardware.PEAK_TFLOPS) by `gpu`, else by the device's name."""

    peak_tflops: float | None = _bound(None, gt=0.0)
    gpu: str | None = None


@dataclass(frozen=True)
class ProfileSpec:
    """torch.profiler traces of optimizer `steps` (each run of consecutive steps one trace;
    () = none) on `ranks` (main: rank 0; all; or a list of ranks), into the run directory's
    profile/; `memory`: CUDA memory snapshots at those steps and when memory runs out."""

    steps: tuple[int, ...] = ()
    ranks: Literal["main", "all"] | tuple[int, ...] = "main"
    memory: bool = False

    def traces(self, rank: int) -> bool:
        """Whether `rank` traces (or snapshots) at all."""
        if self.ranks == "all":
            return True
        return rank == 0 if self.ranks == "main" else rank in self.ranks
