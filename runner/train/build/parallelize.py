"""One place turns a model into its distributed form, in torchtitan's order.

0. float8 training's linear layers (precision=float8, runner.engines.float8);
1. tensor parallelism, by the model's plan, over the mesh's tensor dimension (runner.spec.mesh);
2. activation checkpointing, per block (before anything wraps a block);
3. memory format (channels_last, on CUDA);
4. torch.compile, per block or whole (after checkpointing has wrapped the blocks, before
   FSDP shards them);
5. the engine: DDP's wrap, DeepSpeed's, or FSDP2's shards (runner.engines), over the
   mesh's data dimensions.

Each step changes the module in place or wraps it; state_dict keys stay those of the model
the config builds, so checkpoints and model.pt do not depend on the path taken here.
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
from runner.engines.base import Engine, Fill
from runner.models.blocks import apply_activation_checkpointing
from runner.models.tensor_plans import apply_plan
from runner.spec import RunSpec
from runner.spec.mesh import context_mesh, device_mesh, layout, tensor_mesh
from runner.spec.schema import Precision
from runner.train.build.compiling import CompileClock, compile_model

log = logging.getLogger(__name__)


@dataclass
class Parallelized:
    engine: Engine
    channels_last: bool  # inputs go to the device in channels_last too
    compile_clock: CompileClock | None  # the seconds spent compiling (summary.json)


def parallelize(
    module: nn.Module,
    spec: RunSpec,
    device: str,
    total_steps: int,
    fill: Fill | None = None,
    split_logits: bool = False,
    say: Callable[[str], None] = log.warning,
) -> Parallelized:
    """`module` (built on `device` from the spec, or without its weights: then `fill` fills
    in this rank's shards once the engine sharded it) in its distributed form, ready to
    train for `total_steps` optimizer steps. `split_logits`: the loss runs on logits split
    across a tensor group by vocabulary (loss parallel). `say`: a line for the user (rank
    0's terminal too)."""
    grid = layout(spec, rdist.get_world_size())  # the running group's
    if spec.parallelism.name == "fsdp" and grid.world == 1 and not spec.eval_only:
        say(
            "parallelism=fsdp on 1 rank: nothing to shard, yet FSDP2's hooks gather and free "
            "every block each pass; parallelism=ddp trains the same weights with less work a step"
        )
    if spec.precision.name is Precision.FLOAT8:
        from runner.engines import float8

        sharded = spec.parallelism.name == "fsdp"
        float8.convert(module, spec.precision, torch.device(device).type, sharded, say)
    if grid.tensor > 1:
        mesh = device_mesh(grid, torch.device(device).type)
        plan = getattr(spec.parallelism, "tp_plan", None)
        apply_plan(module, tensor_mesh(mesh), plan, split_logits)
        log.info("tensor parallelism: groups of %d ranks split each layer", grid.tensor)
    if grid.context > 1:
        from runner.models.context_split import apply_context

        group = context_mesh(device_mesh(grid, torch.device(device).type)).get_group()
        rank = grid.context_rank(rdist.get_global_rank())
        ignore = spec.loss.args.get("ignore_index", -100)
        apply_context(module, group, rank, grid.context, ignore)
        log.info("context parallelism: groups of %d ranks split each sequence", grid.context)
    if spec.checkpoint_every:
        selective = spec.activation_checkpointing == "selective"
        apply_activation_checkpointing(module, spec.checkpoint_every, selective)
    channels_last = spec.model.channels_last and torch.device(device).type == "cuda"
    if channels_last:
        module = module.to(memory_format=torch.channels_last)
    clock = None
    if spec.compile is not None:
        clock = CompileClock()
        options = spec.compile
        if grid.pipeline > 1:  # a stage runs its blocks, never the whole model's forward
            options = dataclasses.replace(options, per_block=True)
        compiled = compile_model(module, options, spec.activation_memory_budget)
        log.info("compile: %s", compiled)
    engine = build_engine(spec, module, device, total_steps, fill)
    return Parallelized(engine, channels_last, clock)
