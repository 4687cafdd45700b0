"""A layout's step time on one rank, predicted from the model's facts: no torch here.

    step = compute (+ recompute) + the pipeline's bubble + per-operation overhead
           + the optimizer step + the communication that is not hidden behind compute
           + the engine's own machinery

- compute: the traced FLOPs of a step's forward and backward passes (recomputation
  included) on this rank's share of the batch and of the model, over the device's FLOP/s
  (a GPU's peak from the table at the run's precision; a CPU's measured);
- the bubble: a pipeline of P stages idles (P - 1) microbatches' time of each stage per step;
- overhead: each traced operation costs a fixed time to launch, whatever its size;
- the optimizer: it reads and writes the parameters, gradients and state it holds, at the
  device's memory bandwidth;
- communication: the bytes each engine moves per step over the link's bandwidth
  (ring algorithms: all-reduce 2 (n-1)/n of the buffer, all-gather and reduce-scatter
  (n-1)/n), plus a latency per collective. On a GPU the data-parallel gradient exchange
  overlaps the backward pass; on a CPU the same cores run both, and nothing hides;
- the engine: what a sharding engine's hooks, casts and copies cost beyond all that,
  measured (CPU_SECONDS_PER_ELEMENT, CUDA_SECONDS_PER_TENSOR).
"""

from __future__ import annotations

import math
from typing import Any

from runner.layouts.candidates import Candidate
from runner.layouts.memory import Ranks, _held_params, state_bytes, traced_pass

# Links by device: bytes/s and seconds per collective. On a GPU, NVLink within a node. On a
# CPU the ranks share its cores and talk through gloo (loopback TCP, which the same cores
# copy) or, for ddp and DeepSpeed's zero1 and zero2, through shared memory; the figures are
# measured on a 2-core machine (benchmarks/results/plan.md): gloo moves ~0.2 GB/s and takes
# ~2 ms a collective while both ranks compute.
LINKS = {
    "cpu": {
        "bandwidth": 0.2e9, "shared_memory": 2.0e9, "latency": 2e-3, "per_op": 12e-6,
        "memory_bandwidth": 5e9,
    },
    "cuda": {
        "bandwidth": 150e9, "shared_memory": 150e9, "latency": 20e-6, "per_op": 6e-6,
        "memory_bandwidth": 2e12,
    },
}  # fmt: skip
BETWEEN_NODES = 25e9  # bytes/s between nodes (a 200 Gb/s fabric), for the collectives that cross
# A CPU reaches a share of its measured matrix-product rate that falls with the microbatch:
# CPU_EFFICIENCY x items / (items + CPU_HALF_ITEMS), items being tokens (or samples) per
# microbatch (measured: the gpt's ddp steps at 512 and 256 tokens per microbatch).
CPU_EFFICIENCY, CPU_HALF_ITEMS = 1.0, 117
# What an engine's own machinery costs a CPU step beyond its arithmetic and its bytes, in
# seconds per element of the model: DeepSpeed's flat buffers and its optimizer's wrapper
# (zero1, zero2), ZeRO-3's per-module gathers and releases in Python hooks, FSDP2's and
# DTensor's dispatch (fsdp over several shards, tensor parallelism). Measured against ddp on
# the same gpt (benchmarks/results/plan.md).
CPU_SECONDS_PER_ELEMENT = {"zero1": 2.4e-8, "zero2": 2.4e-8, "zero3": 8e-8, "fsdp": 4e-8}
# The same on a GPU, in seconds per parameter tensor: what the engine's hooks, casts and
# copies launch around each tensor a step, which a GPU's fast arithmetic leaves exposed
# (FSDP2's casts and all-gather copies, ZeRO-3's per-module gathers and releases). Fitted
# on the 12-layer gpt on one H200 (benchmarks/results/gpu_plan.md: fsdp 2.1x ddp's step,
# zero3 5.6x, zero1 1.1x).
CUDA_SECONDS_PER_TENSOR = {"zero1": 2e-5, "zero2": 2e-5, "zero3": 9.7e-4, "fsdp": 2.1e-4}


def step_seconds(facts: dict[str, Any], candidate: Candidate, ranks: Ranks) -> dict[str, float]:
    """The predicted seconds of one optimizer step on one rank, and its parts."""
    link = LINKS["cuda" if ranks.device == "cuda" else "cpu"]
    device = facts["device"]
    dtype = ranks.precision if ranks.precision in device["flops"] else "fp32"
    if ranks.precision == "float8":
        dtype = "bf16" if "bf16" in device["flops"] else "fp32"
    flops_per_s = device["flops"].get(dtype) or device["flops"]["fp32"]
    traced = traced_pass(facts, candidate)
    data = candidate.data_ranks(ranks.world)
    samples = ranks.global_batch / data  # this rank's share of the step's batch
    split = candidate.tensor * candidate.context * candidate.pipeline
    accum = candidate.grad_accum
    if ranks.device != "cuda":  # a CPU's share of its rate falls with the microbatch
        items = samples / accum * (facts.get("sequence") or 1) / candidate.context
        flops_per_s *= CPU_EFFICIENCY * items / (items + CPU_HALF_ITEMS)
    compute = traced["flops_per_sample"] * samples / split / flops_per_s
    bubble = compute * (candidate.pipeline - 1) / accum if candidate.pipeline > 1 else 0.0
    ops = traced.get("ops", 0) * accum / candidate.pipeline
    overhead = ops * link["per_op"]
    state = state_bytes(facts, candidate, ranks)
    optimizer = 2 * state["total"] / link["memory_bandwidth"]
    comm = _communication(facts, candidate, ranks, link, samples)
    exposed = comm["data"] if ranks.device != "cuda" else max(0.0, comm["data"] - 0.6 * compute)
    exposed += comm["model"]
    if ranks.device != "cuda":
        machinery = _cpu_machinery(facts, candidate, ranks)
    else:
        machinery = CUDA_SECONDS_PER_TENSOR.get(candidate.engine, 0.0) * len(facts["params"])
    parts = {
        "compute": compute,
        "bubble": bubble,
        "overhead": overhead,
        "optimizer": optimizer,
        "communication": exposed,
        "engine": machinery,
    }
    return {**parts, "step_s": sum(parts.values())}


def _cpu_machinery(facts: dict[str, Any], candidate: Candidate, ranks: Ranks) -> float:
    """An engine's own cost on a CPU step (CPU_SECONDS_PER_ELEMENT); fsdp pays it where it
    shards over several ranks or runs tensor parallelism's DTensors, not for a pipeline's
    stages alone."""
    engine = candidate.engine
    if engine == "fsdp" and ranks.shards(candidate) == 1 and candidate.tensor == 1:
        return 0.0
    return CPU_SECONDS_PER_ELEMENT.get(engine, 0.0) * sum(facts["params"])


def _communication(
    facts: dict[str, Any],
    candidate: Candidate,
    ranks: Ranks,
    link: dict[str, float],
    samples: float,
) -> dict[str, float]:
    """Seconds of a step's collectives: the data ranks' (gradients, gathered weights) and
    the model split's (tensor parallelism's activations, a pipeline's sends)."""
    width = facts["element_bytes"]
    held = sum(_held_params(facts, candidate)) * width
    data = candidate.data_ranks(ranks.world)
    accum = candidate.grad_accum
    ring = (data - 1) / data if data > 1 else 0.0
    count = 1
    if candidate.engine in ("ddp", "zero1", "zero2"):
        moved = 2 * ring * held  # all-reduce (or reduce-scatter then all-gather)
    else:  # zero3, fsdp: gather forward and backward, every microbatch; reduce-scatter
        shards = ranks.shards(candidate) if candidate.engine == "fsdp" else data
        # expert parallelism: a rank's experts are gathered over the shard ranks left
        experts = (facts.get("experts") or {}).get("elements", 0) * width / candidate.tensor
        experts = experts if candidate.expert > 1 else 0.0
        left = shards // candidate.expert
        moved = (2 * accum + 1) * (held - experts) * ((shards - 1) / shards if shards > 1 else 0)
        moved += (2 * accum + 1) * experts / candidate.expert * (left - 1) / max(1, left)
        count = 2 * accum * max(1, len(facts["blocks"])) + 1
    shared = candidate.engine != "fsdp"  # ddp and DeepSpeed: shared memory on a CPU
    bandwidth = link["shared_memory" if shared else "bandwidth"]
    bandwidth = bandwidth if ranks.nodes == 1 else BETWEEN_NODES
    data_s = moved / bandwidth + (count * link["latency"] if ring else 0.0)
    model_s = 0.0
    blocks = max(1, len(facts["blocks"]))
    if candidate.tensor > 1:  # per block: gather and scatter the residual stream, both ways
        width_guess = math.sqrt(max(facts["blocks"] or [1]) / 12)
        sequence = facts.get("sequence") or 1
        stream = samples * sequence * width_guess * 4 / candidate.context
        tensor_ring = (candidate.tensor - 1) / candidate.tensor
        model_s += blocks * 8 * stream * tensor_ring / link["bandwidth"]
        model_s += blocks * 8 * accum * link["latency"]
    if candidate.pipeline > 1:
        model_s += 2 * accum * link["latency"]
    if candidate.expert > 1:  # each MoE layer's tokens to their experts and back, both ways
        routed = (facts.get("experts") or {}).get("routed", 0)
        tokens = samples * (facts.get("sequence") or 1) / candidate.context / candidate.pipeline
        sent = tokens * routed * width * (candidate.expert - 1) / candidate.expert
        model_s += blocks * 4 * (sent / link["bandwidth"] + accum * link["latency"])
    if candidate.context > 1:
        sequence = facts.get("sequence") or 1
        width_guess = math.sqrt(max(facts["blocks"] or [1]) / 12)
        kv = samples * sequence * width_guess * 2 * 4 / candidate.context
        model_s += blocks * 3 * kv * (candidate.context - 1) / link["bandwidth"]
    return {"data": data_s, "model": model_s}
