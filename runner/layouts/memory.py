"""A layout's memory on one rank, predicted from the model's facts (runner.layouts.model_facts):
no torch here.

- **State** (`state_bytes`): the parameters, gradients and optimizer state the rank holds,
  as each engine holds them and as runner measures them (summary.json's `state_bytes`):
  - ddp: everything, whole;
  - zero1 and zero2: the whole model, plus a partition of fp32 master weights, the
    gradients reduced into a partition (zero1 accumulates them whole over grad_accum's
    microbatches), the optimizer state of that partition;
  - zero3: each parameter's partition (the small ones whole as well, under
    `param_persistence_threshold`), a buffer of gradient partitions (and, when one
    sub-group is the whole partition, its flat copy for the step), the partition's
    optimizer state;
  - fsdp: each parameter's shard, its gradient and optimizer state.

  Tensor parallelism splits every layer across its group; a pipeline stage holds its
  blocks (the heaviest stage holds the model's other layers too).
- **Peak** (`peak_bytes`): the state, plus whichever is larger of the forward and backward
  pass (its activations, traced; the weights a sharded engine gathers; the gradient
  buckets) and the optimizer's step (its temporaries, traced), plus the allocator's margin
  (on a CPU, what a rank holds besides its tensors: `CPU_EXTRA_*`, measured).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from runner.layouts.candidates import Candidate

CUDA_MARGIN = 1.05  # the caching allocator's rounding and fragmentation
CPU_MARGIN = 1.0
# A CPU rank's resident memory holds more than its tensors: what glibc's malloc keeps of what
# it freed (runner maps the large blocks of fsdp's and ZeRO's ranks alone,
# runner.train.build.heap, so they keep least), the kernels' own buffers, gloo's and
# DeepSpeed's communication buffers (DeepSpeed's grow with the model). Measured on this
# project's CPU runs of the gpt at two sizes (benchmarks/results/plan.md), as bytes per byte
# of the model; zero1's and zero2's on a 4x384 gpt and resnet18 after 4 steps.
# The library code a rank maps as it runs is not counted (summary.json's base holds it): what
# looked like a fixed part of some 45 MB was mostly that, and as much as the kernel maps.
CPU_EXTRA_PER_MODEL_BYTE = {"ddp": 1.5, "zero1": 1.0, "zero2": 1.3, "zero3": 1.5, "fsdp": 0.4}
CPU_EXTRA_TENSOR_PER_MODEL_BYTE = 0.9


@dataclass(frozen=True)
class Ranks:
    """The run's ranks, the engine's options and the microbatch, as the spec resolves them."""

    world: int
    global_batch: int
    options: dict[str, Any]  # the candidate's parallelism node (its group's defaults)
    device: str  # cpu | cuda
    precision: str  # fp32 | bf16 | fp16 | float8
    nodes: int = 1

    def micro_batch(self, candidate: Candidate) -> int:
        return self.global_batch // candidate.data_ranks(self.world) // candidate.grad_accum

    def shards(self, candidate: Candidate) -> int:
        """Ranks fsdp shards each parameter over: a copy's data ranks (HSDP keeps
        `replicate` copies; by default one per node) and its context ranks."""
        copies = candidate.replicate or self.nodes
        return max(1, candidate.data_ranks(self.world) // copies) * candidate.context


def state_bytes(facts: dict[str, Any], candidate: Candidate, ranks: Ranks) -> dict[str, int]:
    """Parameters, gradients and optimizer state on the rank that holds the most."""
    params = _held_params(facts, candidate)
    width = facts["element_bytes"]
    whole = sum(params) * width
    data = candidate.data_ranks(ranks.world)
    optimizer = facts["optimizer_state"]
    engine = candidate.engine
    if engine == "ddp":
        state = {"params": whole, "grads": whole, "optimizer": optimizer * whole}
    elif engine in ("zero1", "zero2"):
        # fp32 weights under every precision (runner's ZeRO runs bf16 and fp16 as autocast),
        # a partition of fp32 masters, flat, and of the gradients
        part = math.ceil(sum(params) / data) * 4
        grads = part
        if engine == "zero1" and candidate.grad_accum > 1:  # accumulated whole until the
            grads = whole  # step's boundary, where stage 1 reduces them into its partition
        state = {"params": whole + part, "grads": grads}
        state["optimizer"] = optimizer * part
    elif engine == "zero3":
        part = sum(math.ceil(n / data) for n in params)
        threshold = ranks.options.get("param_persistence_threshold", 100000)
        persistent = sum(n for n in params if n <= threshold) if data > 1 else 0
        # the step's flat copy of a sub-group's gradients: held at the step when one
        # sub-group is the whole partition; a sub-group at a time comes and goes within it
        whole = ranks.options.get("sub_group_size", 10**7) >= part
        copy = part if whole else 0
        state = {"params": (part + persistent) * width, "grads": (part + copy) * width}
        state["optimizer"] = optimizer * part * width
    else:  # fsdp: shards over the data ranks and the context ranks (one batch between them)
        shards = ranks.shards(candidate)
        shard = sum(math.ceil(n / shards) for n in params) * width
        state = {"params": shard, "grads": shard, "optimizer": optimizer * shard}
    state = {key: int(value) for key, value in state.items()}
    return {**state, "total": sum(state.values())}


def _held_params(facts: dict[str, Any], candidate: Candidate) -> list[float]:
    """Elements of each parameter on the rank that holds the most: a pipeline's heaviest
    stage (its share of the blocks, and the layers outside them), split by tensor."""
    params: list[float] = list(facts["params"])
    blocks = facts["blocks"]
    if candidate.pipeline > 1 and blocks:
        per_block = sum(blocks) / len(blocks)
        outside = sum(params) - sum(blocks)
        stage_blocks = math.ceil(len(blocks) / candidate.pipeline)
        params = [outside, *[per_block] * stage_blocks]  # stage's block params, one entry each
    if candidate.tensor > 1:
        params = [n / candidate.tensor for n in params]
    return params


def peak_bytes(facts: dict[str, Any], candidate: Candidate, ranks: Ranks) -> dict[str, int]:
    """The predicted peak of one rank, with its parts: state, activations, gathered weights
    and buckets (forward and backward), the optimizer step's temporaries."""
    state = state_bytes(facts, candidate, ranks)
    activations = activation_bytes(facts, candidate, ranks)
    gathered = _gathered_bytes(facts, candidate, ranks)
    step = _step_bytes(facts, candidate, ranks, state)
    passes = activations + gathered
    if ranks.device != "cuda" and candidate.engine == "zero2":
        # the bucket's pages are written as the backward pass frees the activations
        passes = max(activations, gathered)
    margin = CUDA_MARGIN if ranks.device == "cuda" else CPU_MARGIN
    runtime = 0.0 if ranks.device == "cuda" else _cpu_extra(facts, candidate)
    peak = (state["total"] + max(passes, step)) * margin + runtime
    return {
        "state": state["total"],
        "activations": int(activations),
        "gathered": int(gathered),
        "step": int(step),
        "runtime": int(runtime),
        "peak": int(peak),
    }


def _cpu_extra(facts: dict[str, Any], candidate: Candidate) -> float:
    model = sum(facts["params"]) * facts["element_bytes"]
    per_byte = CPU_EXTRA_PER_MODEL_BYTE[candidate.engine]
    if candidate.tensor > 1:  # DTensor's gathered activations and gloo's buffers for them
        per_byte += CPU_EXTRA_TENSOR_PER_MODEL_BYTE
    return per_byte * model


def traced_pass(facts: dict[str, Any], candidate: Candidate) -> dict[str, float]:
    """The traced pass a candidate runs: its checkpointing mode's, over half weights under
    fsdp where the run computes in bf16 or fp16 (FSDP's MixedPrecisionPolicy)."""
    passes = facts["passes"]
    if candidate.engine == "fsdp" and facts.get("half_passes"):
        passes = facts["half_passes"]
    return passes[candidate.checkpointing if candidate.checkpointing in passes else "none"]


def activation_bytes(facts: dict[str, Any], candidate: Candidate, ranks: Ranks) -> float:
    """The forward and backward pass's own peak on one rank: the traced pass at this
    microbatch, split by context parallelism and by tensor parallelism but for what the
    modules a tensor plan leaves whole make (a mixture's experts: each rank of a tensor
    group runs them on the whole sequence); a pipeline stage holds its share of
    the blocks' for the microbatches in flight (every one under gpipe, one per stage under
    1f1b)."""
    traced = traced_pass(facts, candidate)
    samples = ranks.micro_batch(candidate)
    peak = traced["base"] + traced["per_sample"] * samples
    whole = traced.get("whole", 0.0)  # made where a tensor group runs whole modules (experts)
    peak *= (whole + (1 - whole) / candidate.tensor) / candidate.context
    if candidate.pipeline > 1:
        schedule = ranks.options.get("pipeline_schedule", "1f1b")
        in_flight = candidate.grad_accum if schedule == "gpipe" else candidate.pipeline
        peak = peak / candidate.pipeline * min(in_flight, candidate.grad_accum)
    return max(0.0, peak)


def _gathered_bytes(facts: dict[str, Any], candidate: Candidate, ranks: Ranks) -> float:
    """What a sharded engine gathers while it computes: fsdp and zero3 a block's weights at a
    time (the next one's too, prefetched) and their unsharded gradients, fsdp its root's
    layers and their gradients for the whole pass; zero1 and zero2 a bucket of gradients. An
    engine over a single shard (a pipeline's or tensor group's only data rank) gathers
    nothing."""
    width = facts["element_bytes"]
    blocks = facts["blocks"]
    block = (max(blocks) if blocks else max(facts["params"])) - _expert_share(facts, candidate)
    block = block / candidate.tensor * width
    outside = (sum(facts["params"]) - sum(blocks)) / candidate.tensor * width
    if candidate.engine == "fsdp":
        if ranks.shards(candidate) == 1:
            return 0.0
        keep = ranks.options.get("reshard_after_forward", True)
        held = 3 * block if keep else sum(_held_params(facts, candidate)) * width
        return held + 2 * outside
    if candidate.engine == "zero3":
        return 3 * block if candidate.data_ranks(ranks.world) > 1 else 0.0
    if candidate.engine in ("zero1", "zero2"):
        # DeepSpeed's bucket of contiguous gradients: allocated whole (a GPU holds all of
        # it; a CPU's pages only where it is written, at most the gradients)
        bucket = ranks.options.get("reduce_bucket_size", 5 * 10**8)
        whole = ranks.device == "cuda" and ranks.options.get("contiguous_gradients", True)
        return (bucket if whole else min(bucket, sum(_held_params(facts, candidate)))) * width
    return 0.0


def _expert_share(facts: dict[str, Any], candidate: Candidate) -> float:
    """Elements of a block's experts that its rank does not gather under expert parallelism
    (it holds its own experts, sharded over the shard ranks left): (1 - 1/expert) of them."""
    experts = facts.get("experts") or {}
    if candidate.expert == 1 or not experts.get("elements"):
        return 0.0
    per_block = experts["elements"] / max(1, len(facts["blocks"]))
    return per_block * (1 - 1 / candidate.expert)


def _step_bytes(
    facts: dict[str, Any], candidate: Candidate, ranks: Ranks, state: dict[str, int]
) -> float:
    """The optimizer step's temporaries: traced on the whole model's parameters, one tensor
    at a time, as bytes per byte of its largest tensor, and scaled to what this rank steps at
    once: its largest shard, or DeepSpeed's flat partition (zero3's sub-group of it)."""
    width = facts["element_bytes"]
    largest = max(facts["params"]) * width
    per_byte = facts["optimizer_temporaries"] / max(1, largest)
    if candidate.engine in ("zero1", "zero2", "zero3"):
        stepped = state["optimizer"] / max(facts["optimizer_state"], 1e-9)
        if candidate.engine == "zero3":
            stepped = min(stepped, ranks.options.get("sub_group_size", 10**7) * 4)
        return per_byte * stepped
    shards = ranks.shards(candidate) if candidate.engine == "fsdp" else 1
    return per_byte * largest / (shards * candidate.tensor)
