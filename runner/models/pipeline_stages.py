"""A model cut into pipeline stages (parallelism.pipeline), each part under its name in the
whole model, so that checkpoints, model.pt and init_from read and write the same keys at
every pipeline degree.

runner's gpt is cut by its blocks: the token and position embeddings go with the first
stage, the final norm and the head with the last, and the blocks evenly between the stages
(or `parallelism.pipeline_split` blocks each). A stage passes one tensor to the next: the
activations of its last block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

EMBEDDINGS = ("wte", "wpe", "drop")
HEAD = ("ln_f", "lm_head")


def splits_by_blocks(model: nn.Module) -> bool:
    """Whether `model` has the parts a stage is cut from (runner's gpt)."""
    return all(hasattr(model, name) for name in (*EMBEDDINGS, *HEAD, "blocks"))


def layer_ranges(layers: int, stages: int, split: Sequence[int] = ()) -> list[range]:
    """The blocks of each stage: `split` blocks each, or as many each."""
    counts = list(split) or [layers // stages] * stages
    starts = [sum(counts[:i]) for i in range(stages)]
    return [range(start, start + count) for start, count in zip(starts, counts, strict=True)]


def stage_problems(model: nn.Module, stages: int, split: Sequence[int]) -> list[str]:
    """Why `model` cannot be cut into `stages` stages (`split`: blocks per stage)."""
    name = type(model).__name__
    if not splits_by_blocks(model):
        return [
            f"parallelism.pipeline: {name} has no stage split (runner's gpt is cut by its "
            "blocks: wte/wpe/drop, blocks, ln_f/lm_head); train it with pipeline=1"
        ]
    layers = len(model.blocks)
    if split:
        if len(split) != stages or sum(split) != layers or min(split) < 1:
            return [
                f"parallelism.pipeline_split={list(split)}: needs {stages} counts (pipeline x "
                f"stages_per_rank), each at least 1, that add up to {name}'s {layers} blocks"
            ]
        return []
    if layers % stages:
        valid = [d for d in range(1, layers + 1) if layers % d == 0]
        return [
            f"parallelism.pipeline: {stages} stages (pipeline x stages_per_rank) do not divide "
            f"{name}'s {layers} blocks; stages that do: {valid}, or give "
            "parallelism.pipeline_split (blocks per stage)"
        ]
    return []


class GPTStage(nn.Module):
    """Stage `index` of `count` of runner's gpt: its blocks, and the embeddings (first stage)
    or the final norm and head (last stage). The parts are the gpt's own modules."""

    def __init__(self, gpt: nn.Module, index: int, count: int, blocks: range):
        super().__init__()
        self.first, self.last = index == 0, index == count - 1
        if self.first:
            for name in EMBEDDINGS:
                setattr(self, name, getattr(gpt, name))
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in blocks})
        if self.last:
            for name in HEAD:
                setattr(self, name, getattr(gpt, name))
        self.block_size = gpt.block_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            time = x.shape[1]
            if time > self.block_size:
                raise ValueError(
                    f"a sequence of {time} tokens is longer than block_size={self.block_size}"
                )
            positions = torch.arange(time, device=x.device)
            x = self.drop(self.wte(x) + self.wpe(positions))
        for block in self.blocks.values():
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.last else x


def cut_stages(
    model: nn.Module, indices: Sequence[int], count: int, split: Sequence[int] = ()
) -> list[GPTStage]:
    """The stages `indices` (of `count`) of `model`."""
    problems = stage_problems(model, count, split)
    if problems:
        raise ValueError(problems[0])
    ranges = layer_ranges(len(model.blocks), count, split)
    return [GPTStage(model, i, count, ranges[i]) for i in indices]


class StagedModel(nn.Module):
    """This rank's stages as one module under the whole model's names (what the optimizer,
    checkpoints and model.pt see). Called like the model (evaluation), it runs the stages
    in order across the pipeline's ranks, forward only, and returns the logits on the ranks
    of the last stage, None on the others."""

    def __init__(self, model: nn.Module, stages: list[GPTStage], relay: Any):
        super().__init__()
        for name in (*EMBEDDINGS, "blocks", *HEAD):
            parts = [getattr(s, name) for s in stages if hasattr(s, name)]
            if name == "blocks":
                setattr(self, name, nn.ModuleDict({k: b for p in parts for k, b in p.items()}))
            elif parts:
                setattr(self, name, parts[0])
        self.__dict__["stages"] = stages  # not submodules: the parts above are
        self.__dict__["relay"] = relay
        self.block_size = model.block_size

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Forward only. A padded batch is run whole: the gpt pads at the end, where causal
        attention keeps every real position from seeing the padding, so a real position's
        logits do not depend on the mask (a padded one's are ignored by the loss)."""
        return self.relay(self.stages, input_ids)
