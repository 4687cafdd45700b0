"""A step's microbatches through the pipeline's schedule (parallelism.pipeline): what the
loop's microbatch passes are when the engine runs them all at once.

The schedule's stages are built for one microbatch shape, so each microbatch is padded to
the step's microbatch size by repeating its first sample, and its loss is taken on its own
samples only (a placeholder's on none): the padding costs compute on an epoch's last, smaller
step and changes no gradient. Every rank reads the batch; the first stage feeds it in, the
last computes each microbatch's loss, weighted by the items of the whole global batch like
every other step. The loss sums come back from the last stage's ranks; the other stages'
are zero.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from runner.engines.loss_parallel import loss_of
from runner.engines.precision import autocast
from runner.train.step.batch_parts import batch_size, logits_of, split, to_device
from runner.train.step.loss_pass import LossPass


def padded(batch: Any, size: int, rows: int) -> Any:
    """`batch` of `rows` samples as `size` samples: its first sample repeated at the end."""
    if isinstance(batch, torch.Tensor):
        if not batch.dim() or batch.shape[0] != rows or rows == size:
            return batch
        return torch.cat([batch, batch[:1].expand(size - rows, *batch.shape[1:])])
    if isinstance(batch, Mapping):
        return {k: padded(v, size, rows) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(padded(v, size, rows) for v in batch)
    return batch


def stage_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """The one tensor a first stage takes: the model's one input. An attention mask that
    masks nothing (every sample of full length) is left out; one that masks is refused."""
    mask = kwargs.pop("attention_mask", None)
    if mask is not None and not bool(mask.all()):  # on the host, as the loader made it
        raise ValueError(
            "parallelism.pipeline: the batch pads samples of different lengths (its "
            "attention_mask masks some); a pipeline's stages pass one tensor: train on "
            "samples of one length (data.min_length=null with data.pack=true)"
        )
    given = [*args, *kwargs.values()]
    if len(given) != 1:
        raise ValueError(
            "parallelism.pipeline: a first stage takes one input; this batch gives "
            f"{len(args)} positional and {sorted(kwargs)} keyword inputs"
        )
    return given[0]


def _on_device(
    passes: LossPass, microbatches: list[Any], size: int
) -> tuple[list[torch.Tensor], list[Any]]:
    """Each microbatch's stage input and targets on the device, padded to `size` samples."""
    inputs, targets = [], []
    for batch, real, *_ in microbatches:
        if real:
            passes.faults.forward(batch)
        args, kwargs, target = split(padded(batch, size, batch_size(batch)))
        inputs.append(to_device(stage_input(args, kwargs), passes.device))
        targets.append(to_device(target, passes.device))
    if len({tuple(x.shape) for x in inputs}) > 1:
        raise ValueError(
            "parallelism.pipeline: the step's microbatches differ in shape "
            f"({sorted({tuple(x.shape) for x in inputs})}); a pipeline runs one shape per "
            "step: samples of one length (data.min_length=null with data.pack=true)"
        )
    return inputs, targets


def pipelined_passes(
    pipeline: Any, passes: LossPass, microbatches: list[Any], weight: Any, size: int
) -> list[tuple[torch.Tensor, Any, Any, bool]]:
    """Every microbatch's (loss sum, items, targets, real) of one step, run by the
    pipeline's schedule; gradients left in the stages' parameters."""
    rows = [batch_size(batch) if real else 0 for batch, real, *_ in microbatches]
    inputs, targets = _on_device(passes, microbatches, size)
    records: dict[int, tuple[torch.Tensor, Any]] = {}
    scaler = passes.engine.scaler
    # the schedule's targets are the microbatches' indices (on the host, one to each), so
    # a loss knows which microbatch it scores (the schedule may also call it once on the
    # first, to learn shapes)
    indices = torch.arange(len(microbatches))

    def loss(output: Any, index: torch.Tensor) -> torch.Tensor:
        """Microbatch `index`'s loss."""
        i = int(index)
        target, logits, count = targets[i], logits_of(output), rows[i]
        if not count:  # a placeholder: its passes run, it counts nothing
            return logits.sum() * 0.0
        value, items = loss_of(passes.loss_fn, logits[:count], target[:count])
        value = passes.faults.loss(value)
        records[i] = (value.detach().float(), items)
        weighted = value * weight
        return scaler.scale(weighted) if scaler else weighted

    # under tensor parallelism the logits are split by vocabulary: their backward runs in
    # loss parallel's context
    with autocast(passes.spec.precision, passes.device_type), passes.engine.loss_context():
        pipeline.run(torch.cat(inputs), indices, loss)
    done = []
    zero = torch.zeros((), device=passes.device)
    for i, (batch, real, *_) in enumerate(microbatches):
        target = split(batch)[2]
        if pipeline.has_last:
            loss_sum, items = records.get(i, (zero, 0))
        else:  # the last stage's ranks hold the loss; the items are the targets'
            count = getattr(passes.loss_fn, "count", None)
            loss_sum, items = zero, count(target) if count else len(target)
        done.append((loss_sum, items, target, real))
    return done
