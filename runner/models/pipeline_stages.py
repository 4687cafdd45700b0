"""A model cut into pipeline stages (parallelism.pipeline), each part under its name in the
whole model, so that checkpoints, model.pt and init_from read and write the same keys at
every pipeline degree.

A model is cut by its layer list, and a cut says which of its other modules go with the
first stage (the embeddings), which with the last (the final norm and the head), and which
every stage needs (a rotary embedding, no weights). A model family declares its cut
(runner.models.families: runner's gpt by its blocks, a Hugging Face decoder by model.layers).

The layers go evenly between the stages, or `parallelism.pipeline_split` layers each. Any
other model is cut by a function of the user's (`parallelism.pp_plan`: fn(model, stage,
stages) -> the stage's module, made of the model's own modules). A stage passes one tensor to
the next: the activations of its last layer, a plain tensor. Under tensor parallelism a
rank sends its part of them to the rank at its place in the next stage's tensor group, split
along the sequence where the cut says so (`by_sequence`: the gpt's, its plan's layout between
blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from runner.models.families.family import Cut


def cut_of(model: nn.Module) -> Cut | None:
    """The cut that fits `model`, if its family has one."""
    from runner.models.families import family_of

    cut = family_of(model).pipeline_cut(model)
    paths = (cut.layers, *cut.first, *cut.last, *cut.every) if cut else ()
    return cut if cut and all(_has(model, path) for path in paths) else None


def _has(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def layer_ranges(layers: int, stages: int, split: Sequence[int] = ()) -> list[range]:
    """The layers of each stage: `split` layers each, or as many each."""
    counts = list(split) or [layers // stages] * stages
    starts = [sum(counts[:i]) for i in range(stages)]
    return [range(start, start + count) for start, count in zip(starts, counts, strict=True)]


PLAN_KEY = "parallelism.pp_plan"


def _plan(node: dict[str, Any]) -> Callable[..., nn.Module]:
    import functools

    from runner.components import TARGET, locate

    options = {k: v for k, v in node.items() if not k.startswith("_")}
    return functools.partial(locate(str(node[TARGET])), **options)


def stage_problems(
    model: nn.Module, stages: int, split: Sequence[int], plan: dict[str, Any] | None = None
) -> list[str]:
    """Why `model` cannot be cut into `stages` stages (`split`: layers per stage; `plan`: the
    user's cut, parallelism.pp_plan)."""
    if plan:  # importable, and taking the model, the stage and the stage count
        from runner import components

        return components.problems(PLAN_KEY, plan, {"model": model, "stage": 0, "stages": stages})
    name, cut = type(model).__name__, cut_of(model)
    if cut is None:
        return [
            f"parallelism.pipeline: {name} has no stage split (runner cuts its gpt by blocks "
            "and a Hugging Face decoder by model.layers); give your own in "
            f"{PLAN_KEY}={{_target_: pkg.module.fn}}, fn(model, stage, stages), or pipeline=1"
        ]
    found = cut.problems(model)
    if found:
        return found
    layers = len(model.get_submodule(cut.layers))
    if split:
        if len(split) != stages or sum(split) != layers or min(split) < 1:
            return [
                f"parallelism.pipeline_split={list(split)}: needs {stages} counts (pipeline x "
                f"stages_per_rank), each at least 1, that add up to {name}'s {layers} layers"
            ]
        return []
    if layers % stages:
        valid = [d for d in range(1, layers + 1) if layers % d == 0]
        return [
            f"parallelism.pipeline: {stages} stages (pipeline x stages_per_rank) do not divide "
            f"{name}'s {layers} layers; stages that do: {valid}, or give "
            "parallelism.pipeline_split (layers per stage)"
        ]
    return []


def _place(root: nn.Module, path: str, module: nn.Module) -> None:
    """Set `module` at `path` under `root`, making the containers on the way."""
    *parents, leaf = path.split(".")
    for name in parents:
        if not hasattr(root, name):
            root.add_module(name, nn.Module())
        root = getattr(root, name)
    root.add_module(leaf, module)


def _hold(root: nn.Module, model: nn.Module, cut: Cut, layers: Sequence[int], paths: Any) -> None:
    for path in paths:
        _place(root, path, model.get_submodule(path))
    whole = model.get_submodule(cut.layers)
    _place(root, cut.layers, nn.ModuleDict({str(i): whole[i] for i in layers}))


class StageModule(nn.Module):
    """Stage `index` of `count`: its layers, and the modules of its place in the model, each
    the model's own module under its own name."""

    def __init__(
        self,
        model: nn.Module,
        cut: Cut,
        index: int,
        count: int,
        layers: range,
        tensor_mesh: Any = None,
    ):
        super().__init__()
        self.index, self.first, self.last = index, index == 0, index == count - 1
        paths = (*cut.first,) * self.first + cut.every + (*cut.last,) * self.last
        _hold(self, model, cut, layers, paths)
        self.cut = cut
        self.block_size = getattr(model, "block_size", None)
        self.multiple = getattr(model, "sequence_multiple", 1)
        split = tensor_mesh is not None and cut.by_sequence and not self.first
        self.__dict__["arrives"] = tensor_mesh if split else None  # not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.arrives is not None:  # this rank's part of the sequence
            from torch.distributed.tensor import DTensor, Shard

            x = DTensor.from_local(x, self.arrives, [Shard(1)], run_check=False)
        return sent(self.cut.forward(self, x), self, self.cut.by_sequence)


def sent(y: Any, stage: StageModule | PlannedStage, by_sequence: bool) -> Any:
    """What `stage` passes on: the last stage's output as it is (the loss takes it);
    another's as a plain tensor, this rank's part where they are split along the sequence
    (`by_sequence`: the next stage puts them back so)."""
    from torch.distributed.tensor import DTensor, Shard

    if stage.last or not isinstance(y, DTensor):
        return y
    if not by_sequence or list(y.placements) != [Shard(1)]:
        raise ValueError(
            f"parallelism.pipeline: stage {stage.index} sends a DTensor laid out as "
            f"{list(y.placements)} across the tensor group; between stages activations are "
            "plain tensors (or, in a cut runner knows, split along the sequence)"
        )
    return y.to_local()


class PlannedStage(nn.Module):
    """A stage the user's pp_plan returned."""

    def __init__(self, inner: nn.Module, index: int, count: int):
        super().__init__()
        self.inner = inner
        self.index, self.first, self.last = index, index == 0, index == count - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sent(self.inner(x), self, by_sequence=False)


def cut_stages(
    model: nn.Module,
    indices: Sequence[int],
    count: int,
    split: Sequence[int] = (),
    plan: dict[str, Any] | None = None,
    tensor_mesh: Any = None,
) -> list[nn.Module]:
    """The stages `indices` (of `count`) of `model`, by its cut or the user's `plan`;
    `tensor_mesh`: the tensor group a tensor-parallel model is split across."""
    problems = stage_problems(model, count, split, plan)
    if problems:
        raise ValueError(problems[0])
    if plan:
        stages = []
        for index in indices:
            built = _plan(plan)(model, index, count)
            if not isinstance(built, nn.Module):
                raise ValueError(
                    f"{PLAN_KEY}: returned a {type(built).__name__} for stage {index}, not a "
                    "torch.nn.Module"
                )
            stages.append(PlannedStage(built, index, count))
        return stages
    cut = cut_of(model)
    assert cut is not None
    ranges = layer_ranges(len(model.get_submodule(cut.layers)), count, split)
    return [StageModule(model, cut, i, count, ranges[i], tensor_mesh) for i in indices]


def _owners(model: nn.Module, stages: list[nn.Module]) -> list[tuple[str, nn.Module]]:
    """The largest modules of `model` whose tensors `stages` hold, by their names in `model`,
    in its order."""
    held = {id(t) for s in stages for t in [*s.parameters(), *s.buffers()]}
    owners: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(f"{o}.") for o, _ in owners):
            continue
        tensors = [*module.parameters(), *module.buffers()]
        if tensors and all(id(t) in held for t in tensors):
            owners.append((name, module))
    placed = {id(t) for _, m in owners for t in [*m.parameters(), *m.buffers()]}
    if held - placed:
        raise ValueError(
            f"{PLAN_KEY}: a stage holds tensors that are not its model's own ({len(held - placed)}"
            " of them); cut the model's modules"
        )
    return owners


class StagedModel(nn.Module):
    """This rank's stages as one module under the whole model's names (what the optimizer,
    checkpoints and model.pt see). Called like the model (evaluation), it runs the stages
    in order across the pipeline's ranks, forward only, and returns the logits on the ranks
    of the last stage, on the others what `relay` says of an output held elsewhere."""

    def __init__(self, model: nn.Module, stages: list[nn.Module], relay: Any):
        super().__init__()
        for path, module in _owners(model, stages):
            _place(self, path, module)
        self.__dict__["stages"] = stages  # not submodules: the parts above are
        self.__dict__["relay"] = relay

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> Any:
        """Forward only. A padded batch is run whole: padding sits at the end, where causal
        attention keeps every real position from seeing it, so a real position's logits do
        not depend on the mask (a padded one's are ignored by the loss)."""
        return self.relay(self.stages, input_ids)


def offered(model: nn.Module) -> bool:
    """Whether `model`'s family has a pipeline cut that fits it (runner.spec.mesh.DIMENSIONS)."""
    return cut_of(model) is not None


def spec_problems(model: nn.Module, spec: Any) -> list[str]:
    """Pipeline parallelism's checks of a run's model (runner.spec.mesh.DIMENSIONS): its
    stages' cut, and compile's blocks (a stage never runs the whole forward)."""
    from runner.models.blocks import find_blocks

    if spec.grid.pipeline == 1:
        return []
    options = spec.parallelism
    stages = spec.grid.pipeline * options.stages_each
    found = stage_problems(model, stages, options.pipeline_split, options.pp_plan)
    if spec.compile is not None and not find_blocks(model):
        found.append(
            f"compile: under parallelism.pipeline runner compiles the model's blocks one "
            f"by one (a stage never runs the whole forward), and {type(model).__name__} "
            "has none (a ModuleList of modules of one class); use compile=false"
        )
    return found
