"""The one place a model becomes distributed: parallelize() decides, the engines step.

In this order (torchtitan's), each step in place on the model or around it:

1. float8 training's linear layers (precision=float8: runner.engines.float8), first, so a
   tensor-parallel plan splits the layers as they will run;
2. tensor parallelism: the model's plan over the mesh's tensor dimension
   (runner.models.tensor_plans);
3. context parallelism: the gpt's sequence split across the context dimension
   (runner.models.context_split, through the hook the gpt exposes for it); expert
   parallelism: each MoE layer's experts split across the expert dimension
   (runner.models.expert_split);
4. activation checkpointing, per block (before anything wraps a block);
5. memory format (channels_last, on CUDA);
6. torch.compile, per block or whole (after checkpointing has wrapped the blocks, before
   FSDP shards them; per block under a pipeline, whose stages run blocks);
7. the pipeline cut: this rank's stages (runner.engines.pipeline) under one module;
8. data-parallel wrapping, by the engine of `parallelism` (runner.engines): DDP's wrap,
   DeepSpeed's, or FSDP2's shards over the mesh's data dimensions, then the optimizer; float8
   registers its post-step work on that optimizer.

What was decided is a `RankModel` (runner.engines.rank_model), which the engine takes
whole: the mesh, made once, the module this rank holds, what is sharded, and the answers a
parallelism gives the engine. State_dict keys stay those of the model the config builds,
so checkpoints and model.pt do not depend on the path taken here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from runner import dist as rdist
from runner.engines import build_engine
from runner.engines.base import Engine
from runner.engines.rank_model import SAME_POSITIONS, Apart, Fill, Pairing, RankModel
from runner.models.blocks import apply_activation_checkpointing, find_blocks
from runner.spec import RunSpec
from runner.spec.mesh import Layout
from runner.spec.schema import Precision
from runner.train.build.compiling import CompileClock, compile_model

log = logging.getLogger(__name__)


@dataclass
class Parallelized:
    engine: Engine
    rank_model: RankModel
    channels_last: bool  # inputs go to the device in channels_last too
    compile_clock: CompileClock | None  # the seconds spent compiling (summary.json)


def parallelize(
    module: nn.Module,
    spec: RunSpec,
    grid: Layout,
    device: str,
    total_steps: int,
    fill: Fill | None = None,
    microbatches: int = 1,
    splits_classes: bool = False,
    say: Callable[[str], None] = log.warning,
) -> Parallelized:
    """`module` (built on `device` from the spec, or without its weights: then `fill` fills
    in this rank's shards once the engine sharded it) in its distributed form over `grid`
    (the running group's), ready to train for `total_steps` optimizer steps of
    `microbatches` microbatches on each rank (a pipeline's schedule runs them at once).
    `splits_classes`: the loss can run on logits split by class (loss parallel). `say`: a
    line for the user (rank 0's terminal too)."""
    kind = torch.device(device).type
    _notice_lone_fsdp(spec, grid, say)
    mesh = None
    if spec.parallelism.name == "fsdp":
        from runner.engines.device_mesh import device_mesh

        mesh = device_mesh(grid, kind)
    if spec.precision.name is Precision.FLOAT8:
        from runner.engines import float8

        float8.convert(module, spec.precision, kind, spec.parallelism.name == "fsdp", say)
    if grid.tensor > 1:
        _split_layers(module, spec, grid, mesh, splits_classes)
    pairing = _split_sequence(module, spec, grid, mesh) if grid.context > 1 else SAME_POSITIONS
    if grid.expert > 1:
        _split_experts(module, spec, grid, mesh)
    if spec.checkpoint_every:
        selective = spec.activation_checkpointing == "selective"
        apply_activation_checkpointing(module, spec.checkpoint_every, selective)
    channels_last = spec.model.channels_last and kind == "cuda"
    if channels_last:
        module = module.to(memory_format=torch.channels_last)
    clock = _compile(module, spec, grid)
    rank_model = _cut(module, spec, grid, mesh, device, total_steps, fill, microbatches)
    rank_model.pairing = pairing
    engine = build_engine(spec, rank_model)
    if spec.compile is not None and spec.compile.captures_graphs and not spec.eval_only:
        engine.keep_gradients()  # a replay's outputs never become the gradients
    if spec.precision.name is Precision.FLOAT8 and engine.torch_optimizer is not None:
        from runner.engines import float8

        float8.after_each_step(engine.torch_optimizer, rank_model.module)
    return Parallelized(engine, rank_model, channels_last, clock)


def _notice_lone_fsdp(spec: RunSpec, grid: Layout, say: Callable[[str], None]) -> None:
    if spec.parallelism.name == "fsdp" and grid.world == 1 and not spec.eval_only:
        say(
            "parallelism=fsdp on 1 rank: nothing to shard, yet FSDP2's hooks gather and free "
            "every block each pass; parallelism=ddp trains the same weights with less work a step"
        )


def _split_layers(
    module: nn.Module, spec: RunSpec, grid: Layout, mesh: object, splits_classes: bool
) -> None:
    """Tensor parallelism: each layer split across a tensor group by the model's plan. The
    logits stay split by class where the loss runs on them so, except under context
    parallelism (torch 2.11 refuses loss parallel on its padded logits)."""
    from runner.engines.device_mesh import tensor_mesh
    from runner.models.tensor_plans import apply_plan

    split_logits = splits_classes and grid.context == 1
    apply_plan(module, tensor_mesh(mesh), spec.parallelism.tp_plan, split_logits)
    log.info("tensor parallelism: groups of %d ranks split each layer", grid.tensor)


def _split_sequence(module: nn.Module, spec: RunSpec, grid: Layout, mesh: object) -> Pairing:
    """Context parallelism: the gpt's sequence split across a context group; the loss pairs
    this rank's positions with the tokens that follow them."""
    from runner.engines.device_mesh import context_mesh
    from runner.models.context_split import apply_context

    group = context_mesh(mesh).get_group()
    rank = grid.context_rank(rdist.get_global_rank())
    ignore = spec.loss.args.get("ignore_index", -100)
    split = apply_context(module, group, rank, grid.context, ignore)
    log.info("context parallelism: groups of %d ranks split each sequence", grid.context)
    return split


def _split_experts(module: nn.Module, spec: RunSpec, grid: Layout, mesh: object) -> None:
    """Expert parallelism: each MoE layer's experts split across an expert group."""
    from runner.engines.device_mesh import expert_mesh
    from runner.models.expert_split import apply_experts

    apply_experts(module, expert_mesh(mesh), spec.parallelism.ep_plan)
    log.info("expert parallelism: groups of %d ranks split each layer's experts", grid.expert)


def _compile(module: nn.Module, spec: RunSpec, grid: Layout) -> CompileClock | None:
    if spec.compile is None:
        return None
    clock = CompileClock()
    options = spec.compile
    if grid.pipeline > 1:  # a stage runs its blocks, never the whole model's forward
        options = dataclasses.replace(options, per_block=True)
    log.info("compile: %s", compile_model(module, options, spec.activation_memory_budget))
    return clock


def _cut(
    module: nn.Module,
    spec: RunSpec,
    grid: Layout,
    mesh: object,
    device: str,
    total_steps: int,
    fill: Fill | None,
    microbatches: int,
) -> RankModel:
    """What this rank holds: the model, or under pipeline parallelism its stages, each
    sharded as a model of its own (`roots`), with the blocks among them."""
    options = spec.parallelism
    blocks = find_blocks(module, options.wrap) if options.name == "fsdp" else []
    rank_model = RankModel(
        grid, device, module, total_steps, fill, mesh, roots=[module], blocks=blocks
    )
    if grid.tensor > 1:
        from runner.engines.loss_parallel import split_loss

        rank_model.loss_context = split_loss  # a loss on logits split by class: its backward there
    if spec.precision.name is Precision.FLOAT8:
        from runner.engines.float8 import gathers_in_float8

        rank_model.keep_last_gathered = not gathers_in_float8(module)  # scales are the shards'
    rank_model.several_meshes = grid.tensor > 1 or grid.pipeline > 1 or grid.expert > 1
    if grid.pipeline > 1:
        from runner.engines.pipeline import Pipeline

        pipeline = Pipeline(spec, module, grid, mesh, device, microbatches)
        held = {id(m) for m in pipeline.module.modules()}
        rank_model.module, rank_model.stages = pipeline.module, pipeline
        rank_model.roots = pipeline.parts
        rank_model.blocks = [b for b in blocks if id(b) in held]
        rank_model.keep_every_gathered = True  # each microbatch would gather a freed block
    if grid.expert > 1 and rank_model.blocks:
        rank_model.apart = _experts_apart(rank_model.blocks, mesh, grid.expert)
    return rank_model


def _experts_apart(blocks: list[nn.Module], mesh: object, groups: int) -> dict[int, list[Apart]]:
    """Each block's split experts, sharded over the data ranks but their group's; the
    gradient's mean over the groups is FSDP's over that mesh, the group's divided after."""
    from runner.engines.device_mesh import expert_data_mesh
    from runner.models.expert_split import split_experts

    over = expert_data_mesh(mesh)
    return {id(b): [Apart(m, over, groups) for m in split_experts(b)] for b in blocks}
