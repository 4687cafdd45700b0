"""The layouts a plan weighs: each a set of ordinary config keys a user could have given.

A candidate is an engine (ddp, zero1, zero2, zero3, fsdp), fsdp's mesh (replicate and the
model splits: pipeline, expert, context, tensor), an activation-checkpointing mode and
grad_accum. `candidates` lists every one that could apply to the run: each split the model
offers at the degrees its dimension declares (runner.spec.mesh.DIMENSIONS: a block per
pipeline stage at least, experts shared out evenly, context where sequences are long,
tensor within a node and dividing the heads), together where the mesh arithmetic holds
and they compose (`degree_problems`, the check a hand-written layout meets); HSDP where
there are several nodes; and every grad_accum that divides a data rank's share of the
batch. The spec's own checks then say which are valid (runner.layouts.planner).
"""

from __future__ import annotations

import itertools
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from runner.spec.mesh import SPLITS, Reach, degree_problems, divisors

ENGINES = ("ddp", "zero1", "zero2", "zero3", "fsdp")


@dataclass(frozen=True)
class Candidate:
    engine: str
    checkpointing: str = "none"  # activation_checkpointing: none | full | selective
    grad_accum: int = 1
    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    replicate: int | None = None  # fsdp's copies (HSDP); None: fsdp's default
    expert: int = 1  # groups of shard ranks that split each layer's experts

    @property
    def model_split(self) -> int:
        """Ranks that hold parts of one copy of the model besides the data ranks."""
        return self.tensor * self.pipeline * self.context

    def data_ranks(self, world: int) -> int:
        return world // self.model_split

    def overrides(self) -> dict[str, Any]:
        """The config keys that make this layout, as a user would give them."""
        keys: dict[str, Any] = {"parallelism": self.engine}
        for key in ("tensor", "pipeline", "context", "expert", "replicate"):
            value = getattr(self, key)
            if value not in (1, None):
                keys[f"parallelism.{key}"] = value
        keys["activation_checkpointing"] = self.checkpointing
        keys["grad_accum"] = self.grad_accum
        return keys

    @property
    def name(self) -> str:
        """A short name for tables: `fsdp tp2 pp2 ac=full accum=4`."""
        parts = [self.engine]
        shorts = (("tp", self.tensor), ("pp", self.pipeline), ("cp", self.context))
        for short, value in (*shorts, ("ep", self.expert)):
            if value > 1:
                parts.append(f"{short}{value}")
        if self.replicate is not None:
            parts.append(f"rep{self.replicate}")
        if self.checkpointing != "none":
            parts.append(f"ac={self.checkpointing}")
        parts.append(f"accum={self.grad_accum}")
        return " ".join(parts)


def candidates(
    *,
    nproc: int,
    nodes: int,
    global_batch: int,
    blocks: int,
    heads: int | None,
    sequence: int | None,
    splits: Collection[str] = (),
    experts: int = 0,
) -> list[Candidate]:
    """Every layout weighed for `nodes` x `nproc` ranks. `blocks`: the model's repeated
    blocks (0: none to checkpoint or cut into stages); `splits`: the dimensions the model
    offers (runner.spec.mesh.offered_splits); `experts`: experts per MoE layer."""
    world = nproc * nodes
    modes = ("none", "full", "selective") if blocks else ("none",)
    meshes: list[dict[str, Any]] = [{"engine": engine} for engine in ENGINES]
    if nodes > 1:  # fsdp's default is a copy per node (HSDP); sharding over every rank too
        meshes.append({"engine": "fsdp", "replicate": 1})
    reach = Reach(nproc, world, blocks, heads, sequence, experts)
    meshes += _split_meshes(reach, nodes, splits)
    found = []
    for mesh in meshes:
        split = mesh.get("tensor", 1) * mesh.get("pipeline", 1) * mesh.get("context", 1)
        share = global_batch // (world // split) if global_batch % (world // split) == 0 else 0
        for mode in modes:
            for accum in divisors(share) if share else [1]:
                found.append(Candidate(checkpointing=mode, grad_accum=accum, **mesh))
    return found


def _split_meshes(reach: Reach, nodes: int, splits: Collection[str]) -> list[dict[str, Any]]:
    """fsdp meshes that split the model: each offered dimension's degrees, alone and
    together, where the grid holds (a copy per node, or one over every rank)."""
    weighed = [d for d in SPLITS if d.name in splits and d.degrees is not None]
    names = [d.name for d in weighed]
    degrees = [d.degrees(reach) for d in weighed]
    ones = dict.fromkeys((d.name for d in SPLITS), 1)
    meshes = []
    for replicate in dict.fromkeys((nodes, 1)):  # fsdp's default copies, then sharded across
        for combination in itertools.product(*degrees):
            sizes = ones | dict(zip(names, combination, strict=True))
            holds = not degree_problems(reach.world, reach.nproc, replicate, sizes)
            if holds and max(sizes.values()) > 1:
                mesh = {"engine": "fsdp", **{k: v for k, v in sizes.items() if v > 1}}
                meshes.append(mesh if replicate == nodes else {**mesh, "replicate": 1})
    return meshes
