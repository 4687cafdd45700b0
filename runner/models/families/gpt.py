"""runner's gpt (runner.models.gpt) as a model family: its blocks, its heads, its tensor plan
(Megatron's layout, with sequence parallelism between), its cut into pipeline stages, and its
sequence hook for context parallelism. gpt_moe, built on it, declares itself in gpt_moe.py.

The tensor plan:
- the token and position embeddings split by rows (vocabulary, positions), their sum
  scattered along the sequence;
- in each block, the norms run on the rank's part of the sequence (sequence parallel);
  attention and the MLP gather it, their first layers (qkv, mlp.0) split column-wise (each
  rank its own heads, its own part of the hidden width) and their last (proj, mlp.2)
  row-wise, reduced and scattered back along the sequence;
- gpt_moe's mixture of experts in place of the MLP: not split; each rank routes the whole
  gathered sequence through whole experts and keeps its part of the output;
- the final norm sequence-parallel, the head column-wise; its logits stay split by
  vocabulary where the loss runs on them so (loss parallel: runner.engines.loss_parallel),
  else they are gathered whole.

Its pipeline cut: `wte`, `wpe`, `drop` | `blocks` | `ln_f`, `lm_head`; under tensor
parallelism a stage's activations are split along the sequence, and the first stage pads
the sequence to a multiple of the tensor group as the whole gpt does.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from runner.models.families.family import Cut, Family, TensorPlan

if TYPE_CHECKING:
    import torch
    from torch import nn

    from runner.models.pipeline_stages import StageModule


class GptFamily(Family):
    name = "gpt"
    order = 20
    checks_itself = True  # it checks its options as it is built
    module = "runner.models.gpt"

    def claims(self, model: nn.Module) -> bool:
        from runner.models.gpt import GPT

        return isinstance(model, GPT)

    def builds(self, target: str) -> bool:
        return target.rpartition(".")[0] == self.module

    def heads(self, model: nn.Module) -> int | None:
        return model.blocks[0].attn.n_head

    def tensor_plan(self, model: nn.Module, split_logits: bool) -> TensorPlan | None:
        return functools.partial(gpt_plan, split_logits=split_logits)

    def tensor_problems(self, model: nn.Module, tensor: int) -> list[str]:
        return gpt_problems(model, tensor)

    def pipeline_cut(self, model: nn.Module) -> Cut | None:
        first, last = ("wte", "wpe", "drop"), ("ln_f", "lm_head")
        return Cut("blocks", first, last, (), _stage_forward, by_sequence=True)

    def context_problems(self, model: nn.Module, context: int) -> list[str]:
        return []

    def hook_sequence(self, model: nn.Module, split: Any) -> None:
        model.sequence = split
        for block in model.blocks:
            block.attn.sequence = split


FAMILY = GptFamily()


def _stage_forward(stage: StageModule, x: torch.Tensor) -> torch.Tensor:
    """A pipeline stage of the gpt: the first embeds (padding the sequence to the tensor
    group's equal parts; the pipeline crops it), the last norms and projects."""
    import torch

    if stage.first:
        time = x.shape[1]
        if time > stage.block_size:
            raise ValueError(
                f"a sequence of {time} tokens is longer than block_size={stage.block_size}"
            )
        pad = -time % stage.multiple
        x = torch.nn.functional.pad(x, (0, pad)) if pad else x
        positions = torch.arange(time + pad, device=x.device)
        x = stage.drop(stage.wte(x) + stage.wpe(positions))
    for block in stage.blocks.values():
        x = block(x)
    return stage.lm_head(stage.ln_f(x)) if stage.last else x


def gpt_problems(model: nn.Module, tensor: int, key: str = "parallelism.tensor") -> list[str]:
    """What runner's gpt plan needs: every size it splits divisible by the group."""
    first = model.blocks[0].attn
    sizes = {
        "model.n_head": first.n_head,
        "model.n_embd": model.n_embd,
        "the vocabulary (data's vocab_size)": model.wte.num_embeddings,
    }
    return [
        f"{key}={tensor}: must divide {name}={size} (the gpt's plan splits it across the "
        f"tensor group)"
        for name, size in sizes.items()
        if size % tensor
    ]


def gpt_plan(
    model: nn.Module, mesh: Any, split_logits: bool = False, experts: bool = False
) -> None:
    """runner's gpt across the ranks of `mesh` (the tensor dimension): see the module text.
    `split_logits`: the head's logits stay split by vocabulary (a DTensor, for a loss that
    runs on them so: loss parallel), else they are gathered whole. `experts`: its blocks'
    mixtures of experts (gpt_moe's) in place of MLPs."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    # The residual stream stays a DTensor split along the sequence (use_local_output=False);
    # the gpt pads its sequence to a multiple of the group, so every rank holds an equal part
    # (an uneven split broke torch 2.11's DTensor linear, and compiled blocks at a second
    # length: each rank compiled its own, and their collectives disagreed in size).
    model.sequence_multiple = mesh.size()
    sequence, gathered = Shard(1), Replicate()
    head = (
        ColwiseParallel(input_layouts=sequence, output_layouts=Shard(-1), use_local_output=False)
        if split_logits
        else ColwiseParallel(input_layouts=sequence, output_layouts=gathered)
    )
    parallelize_module(
        model,
        mesh,
        {
            "wte": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=sequence, use_local_output=False
            ),
            "wpe": RowwiseParallel(
                input_layouts=Replicate(), output_layouts=Shard(0), use_local_output=False
            ),
            "ln_f": SequenceParallel(),
            "lm_head": head,
        },
    )
    for block in model.blocks:
        parallelize_module(block, mesh, _gpt_block_plan(experts))


def _gpt_block_plan(experts: bool = False) -> dict[str, Any]:
    """A gpt block's layers: norms on the rank's part of the sequence, attention and the MLP
    on all of it, their first layers split by columns, their last by rows (reduced and
    scattered back along the sequence). A mixture of experts (gpt_moe's `moe`) is not
    split: every rank of the group routes and computes the whole sequence (gathered) with
    whole experts, and keeps its part of the output."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    sequence, gathered = Shard(1), Replicate()
    attention = {
        "ln_1": SequenceParallel(),
        "attn": PrepareModuleInput(
            input_layouts=(sequence, None), desired_input_layouts=(gathered, None)
        ),
        "attn.qkv": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=sequence, use_local_output=False),
        "ln_2": SequenceParallel(),
    }
    if experts:
        moe = PrepareModuleInputOutput(
            input_layouts=(sequence,), desired_input_layouts=(gathered,), use_local_input=True,
            output_layouts=(gathered,), desired_output_layouts=(sequence,),
            use_local_output=False,
        )  # fmt: skip
        return attention | {"moe": moe}
    return attention | {
        "mlp": PrepareModuleInput(input_layouts=(sequence,), desired_input_layouts=(gathered,)),
        "mlp.0": ColwiseParallel(),
        "mlp.2": RowwiseParallel(output_layouts=sequence, use_local_output=False),
    }
