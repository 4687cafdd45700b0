"""The layouts a plan weighs: each a set of ordinary config keys a user could have given.

A candidate is an engine (ddp, zero1, zero2, zero3, fsdp), fsdp's mesh (replicate, tensor,
pipeline, context, expert), an activation-checkpointing mode and grad_accum. `candidates`
lists every one that could apply to the run, before any check: for the splits the model
has plans of its own for, the tensor degrees that divide a node's ranks and the model's
heads, the pipeline degrees that divide the world and leave a block per stage, context
where sequences are long, and the expert degrees that divide the shard ranks and the
experts; HSDP where there are several nodes; and every grad_accum that divides a data
rank's share of the batch. The spec's own checks then
say which are valid (runner.layouts.planner).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from runner.spec.mesh import all_compose

ENGINES = ("ddp", "zero1", "zero2", "zero3", "fsdp")
LONG_SEQUENCE = 2048  # tokens per sample from which context parallelism is weighed


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


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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
    blocks (0: none to checkpoint or cut into stages); `splits`: the splits the model has
    plans for (tensor, pipeline, context, expert); `experts`: experts per MoE layer."""
    world = nproc * nodes
    modes = ("none", "full", "selective") if blocks else ("none",)
    meshes: list[dict[str, Any]] = [{"engine": engine} for engine in ENGINES]
    if nodes > 1:  # fsdp's default is a copy per node (HSDP); sharding over every rank too
        meshes.append({"engine": "fsdp", "replicate": 1})
    meshes += _model_splits(nproc, world, blocks, heads, sequence, splits)
    if "expert" in splits:
        meshes += _expert_splits(meshes, world, nodes, experts)
    found = []
    for mesh in meshes:
        split = mesh.get("tensor", 1) * mesh.get("pipeline", 1) * mesh.get("context", 1)
        share = global_batch // (world // split) if global_batch % (world // split) == 0 else 0
        for mode in modes:
            for accum in divisors(share) if share else [1]:
                found.append(Candidate(checkpointing=mode, grad_accum=accum, **mesh))
    return found


def _model_splits(
    nproc: int,
    world: int,
    blocks: int,
    heads: int | None,
    sequence: int | None,
    splits: Collection[str],
) -> list[dict[str, Any]]:
    """fsdp meshes that split the model: tensor within a node (dividing the heads), pipeline
    (a block per stage at least), context (long sequences), alone and together where they
    compose (runner.spec.mesh.DIMENSIONS)."""
    tensors = [t for t in divisors(nproc) if heads is None or heads % t == 0]
    tensors = tensors if "tensor" in splits else [1]
    pipelines = [p for p in divisors(world) if p <= max(1, blocks)]
    pipelines = pipelines if "pipeline" in splits else [1]
    long = sequence and sequence >= LONG_SEQUENCE and "context" in splits
    contexts = divisors(nproc) if long else [1]
    meshes = []
    for tensor in tensors:
        for pipeline in pipelines:
            for context in contexts:
                split = tensor * pipeline * context
                sizes = {"tensor": tensor, "pipeline": pipeline, "context": context}
                if split == 1 or world % split or not all_compose(sizes):
                    continue
                mesh = {"engine": "fsdp", "tensor": tensor, "pipeline": pipeline}
                meshes.append({**mesh, "context": context})
    return meshes


def _expert_splits(
    meshes: list[dict[str, Any]], world: int, nodes: int, experts: int
) -> list[dict[str, Any]]:
    """Each fsdp mesh (of dimensions that compose with experts) with every expert degree
    above 1 that divides its shard ranks and the experts per layer."""
    found = []
    for mesh in meshes:
        sizes = {k: v for k, v in mesh.items() if k != "engine" and isinstance(v, int)}
        if mesh["engine"] != "fsdp" or not all_compose({**sizes, "expert": 2}):
            continue
        split = mesh.get("tensor", 1) * mesh.get("pipeline", 1)
        shard = world // split // (mesh.get("replicate") or nodes)
        for expert in divisors(shard)[1:]:
            if experts % expert == 0:
                found.append({**mesh, "expert": expert})
    return found
