"""Expert parallelism (parallelism.expert=E): each mixture-of-experts layer's experts split
across a group of E data ranks, n_experts / E each, in group order; a token goes to the
rank that holds its expert and back by all-to-all (runner.models.expert_exchange).

The split experts are DTensors over the mesh's expert dimension, split by expert (dim 0):
FSDP2 then shards each rank's experts further over the other data ranks, and a checkpoint,
model.pt and the optimizer's state see every expert under its global index, so a run
resumes at another expert degree, or under ddp. The other layers are untouched: FSDP
shards them over every data rank, the expert groups included (they read different data).

What the experts' gradients need: every rank of a group sends its tokens' gradients to the
experts' ranks, so an expert's gradient on its rank sums the group's tokens; FSDP then sums
over the rest of the data ranks and divides by all of them (runner.engines.fsdp).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from runner.models.moe import MoE


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def expert_problems(model: nn.Module, expert: int) -> list[str]:
    """What expert parallelism needs of the model: mixture-of-experts layers (runner's),
    whose experts the group splits evenly."""
    key = f"parallelism.expert={expert}"
    layers = moe_layers(model)
    if not layers:
        return [
            f"{key}: {type(model).__name__} has no mixture-of-experts layer to split "
            "(model=gpt_moe has them); use parallelism.expert=1"
        ]
    counts = sorted({m.n_experts for m in layers})
    return [
        f"{key}: must divide model.n_experts={n} (each rank of a group holds as many experts)"
        for n in counts
        if n % expert
    ]


def apply_experts(model: nn.Module, mesh: Any) -> None:
    """Split every MoE layer's experts over `mesh` (the expert dimension), in place: this
    rank keeps its own as the local part of DTensors of the whole experts' shape."""
    from torch.distributed.tensor import DTensor, Shard

    degree, rank = mesh.size(), mesh.get_local_rank()
    for layer in moe_layers(model):
        local = layer.n_experts // degree
        layer.expert_group, layer.experts_per_rank = mesh.get_group(), local
        for name, param in list(layer.experts.named_parameters(recurse=False)):
            own = param.detach()[rank * local : (rank + 1) * local].clone()
            split = DTensor.from_local(own, mesh, [Shard(0)], run_check=False)
            setattr(layer.experts, name, nn.Parameter(split, requires_grad=param.requires_grad))
