"""What runner asks of a kind of model, and the answers for a model it knows nothing of (a
user's own): a `Family`. Each family runner knows (its gpt, gpt_moe, Hugging Face causal
LMs, torchvision and timm classifiers) declares itself once, in its own module of this
package, as a subclass whose answers are that kind of model's; runner.models.families finds
them. parallelize(), preflight, the planner and export ask a model's family, and never look
at its class or its target themselves.

A family answers from the model (built, or on the meta device) or, before anything is
built, from the `_target_` that builds it (`builds`: which modules a rank may import ahead,
whether building the model checks its options).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from torch import nn

    from runner.spec import RunSpec

TensorPlan = Callable[["nn.Module", Any], None]  # fn(model, the tensor dimension's mesh)


@dataclass(frozen=True)
class Cut:
    """How one kind of model is cut into pipeline stages (runner.models.pipeline_stages):
    its layer list and the modules beside it."""

    layers: str
    first: tuple[str, ...]
    last: tuple[str, ...]
    every: tuple[str, ...]
    forward: Callable[[Any, torch.Tensor], torch.Tensor]  # fn(stage, its input)
    by_sequence: bool = False  # under tensor parallelism, activations split along dim 1
    # why a model of the kind cannot be cut so, beyond its layer count
    problems: Callable[[nn.Module], list[str]] = lambda model: []


NO_EXPERTS = {"count": 0, "elements": 0, "routed": 0}


class Family:
    """A kind of model. This base is the generic family, which claims every model: blocks
    found by looking (the largest list of modules of one class), no plan of its own for
    tensor, pipeline or context parallelism (a user brings hers: parallelism.tp_plan,
    pp_plan), no experts of its own."""

    name = "generic"
    order = 100  # families are asked in this order; the generic one last

    def claims(self, model: nn.Module) -> bool:
        """Whether `model` is of this family."""
        return True

    def builds(self, target: str) -> bool:
        """Whether `target` (model._target_) builds a model of this family."""
        return True

    def preloads(self, target: str, device: str) -> list[str]:
        """Modules a rank building `target` on `device` imports, which the fork server may
        import once for every rank (`module:attribute` for an attribute loaded on first
        use)."""
        return []

    checks_itself = False  # building it (on the meta device: free) checks its options

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The unit the model repeats, in order (what activation checkpointing, FSDP's wrap,
        compiling and the planner take one by one): by default the children of its largest
        list of modules of one class (runner's gpt's `blocks`, a decoder's `layers`)."""
        return largest_repeated(model)

    def heads(self, model: nn.Module) -> int | None:
        """Its attention heads (what tensor parallelism splits), when the model says."""
        return None

    def tensor_plan(self, model: nn.Module, split_logits: bool) -> TensorPlan | None:
        """Its own tensor-parallel plan, if it has one. `split_logits`: the loss runs on
        logits split by vocabulary, so a plan that can leave them so does."""
        return None

    def tensor_problems(self, model: nn.Module, tensor: int) -> list[str]:
        """Why its own plan cannot split it across `tensor` ranks."""
        return []

    def pipeline_cut(self, model: nn.Module) -> Cut | None:
        """How it is cut into pipeline stages, if it has a cut of its own."""
        return None

    def context_problems(self, model: nn.Module, context: int) -> list[str]:
        """Why its sequence cannot be split across `context` ranks."""
        return [
            f"parallelism.context={context}: runner cannot split {type(model).__name__}'s "
            "attention across ranks (it splits runner's gpt); train it with context=1"
        ]

    def hook_sequence(self, model: nn.Module, split: Any) -> None:
        """Hand its forward pass the context split (runner.models.context_split.ContextSplit)
        in place of the whole sequence."""
        raise ValueError(f"{type(model).__name__} has no sequence to split")

    def experts(self, model: nn.Module) -> dict[str, int]:
        """Its mixture-of-experts layers: experts per layer (0: none), the elements of every
        experts module expert parallelism splits, and the values a routed token sends to its
        experts (top_k x width)."""
        return dict(NO_EXPERTS)

    experts_key: str | None = None  # its config's key of the experts per layer, for messages

    def expert_patterns(self, model: nn.Module) -> list[str]:
        """The names of its experts modules (patterns, `*` a layer number) that expert
        parallelism splits by their own forward (runner.models.expert_dispatch's contract),
        where the model names them itself; the user's parallelism.ep_plan names others."""
        return []

    def tensor_whole(self, model: nn.Module) -> list[str]:
        """The modules (patterns) its tensor plan leaves whole: each rank of a tensor group
        runs them on the whole gathered sequence, so their activations are not split (a
        mixture's experts, in runner's gpt_moe and transformers' plans alike)."""
        return self.expert_patterns(model)

    def ready_to_train(self, model: nn.Module) -> str | None:
        """Set what training wants of it that its defaults do not; what was set, if any."""
        return None

    # export (runner export): the files a model of this family is read back from
    export_kind = ""  # said of the export, after its size (", a Hugging Face model")

    def exported(self, model: nn.Module, tensors: list[Any]) -> list[Any]:
        """The weights as its own checkpoints name them (runner.models.safetensors_out's
        OutTensor), left out those it ties to others."""
        return tensors

    def export_beside(self, model: nn.Module, spec: RunSpec, to: Path) -> list[Path]:
        """The files written beside the weights (a config, the tokenizer)."""
        return []

    def __repr__(self) -> str:
        return f"<model family {self.name}>"


def largest_repeated(module: nn.Module) -> list[nn.Module]:
    """The children of the module's largest container of same-class modules that hold
    parameters (none if it has no such container)."""
    from torch import nn

    best: list[nn.Module] = []
    for candidate in module.modules():
        if not isinstance(candidate, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(candidate.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        if len(children) > len(best) and list(children[0].parameters()):
            best = children
    return best
