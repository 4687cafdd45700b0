"""A layout's step time on one rank, predicted from the model's facts: no torch here.

    step = compute (+ recompute) + the pipeline's bubble + per-operation overhead
           + the optimizer step + the communication that is not hidden behind compute

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
  overlaps the backward pass; on a CPU the same cores run both, and nothing hides.
"""

from __future__ import annotations

import math
from typing import Any

from runner.layouts.candidates import Candidate
from runner.layouts.memory import Ranks, _held_params, state_bytes

# Links by device: bytes/s and seconds per collective. A CPU's ranks talk over gloo
# (loopback TCP, or shared memory for ddp), a GPU's over NVLink within a node.
LINKS = {
    "cpu": {"bandwidth": 2.0e9, "latency": 60e-6, "per_op": 12e-6, "memory_bandwidth": 5e9},
    "cuda": {"bandwidth": 150e9, "latency": 20e-6, "per_op": 6e-6, "memory_bandwidth": 2e12},
}
BETWEEN_NODES = 25e9  # bytes/s between nodes (a 200 Gb/s fabric), for the collectives that cross


def step_seconds(facts: dict[str, Any], candidate: Candidate, ranks: Ranks) -> dict[str, float]:
    """The predicted seconds of one optimizer step on one rank, and its parts."""
    link = LINKS["cuda" if ranks.device == "cuda" else "cpu"]
    device = facts["device"]
    dtype = ranks.precision if ranks.precision in device["flops"] else "fp32"
    if ranks.precision == "float8":
        dtype = "bf16" if "bf16" in device["flops"] else "fp32"
    flops_per_s = device["flops"].get(dtype) or device["flops"]["fp32"]
    mode = candidate.checkpointing if candidate.checkpointing in facts["passes"] else "none"
    traced = facts["passes"][mode]
    data = candidate.data_ranks(ranks.world)
    samples = ranks.global_batch / data  # this rank's share of the step's batch
    split = candidate.tensor * candidate.context * candidate.pipeline
    compute = traced["flops_per_sample"] * samples / split / flops_per_s
    accum = candidate.grad_accum
    bubble = compute * (candidate.pipeline - 1) / accum if candidate.pipeline > 1 else 0.0
    ops = traced.get("ops", 0) * accum / candidate.pipeline
    overhead = ops * link["per_op"]
    state = state_bytes(facts, candidate, ranks)
    optimizer = 2 * state["total"] / link["memory_bandwidth"]
    comm = _communication(facts, candidate, ranks, link, samples)
    exposed = comm["data"] if ranks.device != "cuda" else max(0.0, comm["data"] - 0.6 * compute)
    exposed += comm["model"]
    parts = {
        "compute": compute,
        "bubble": bubble,
        "overhead": overhead,
        "optimizer": optimizer,
        "communication": exposed,
    }
    return {**parts, "step_s": sum(parts.values())}


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
        shards = data * candidate.context
        moved = (2 * accum + 1) * held * ((shards - 1) / shards if shards > 1 else 0.0)
        count = 2 * accum * max(1, len(facts["blocks"])) + 1
    bandwidth = link["bandwidth"] if ranks.nodes == 1 else BETWEEN_NODES
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
    if candidate.context > 1:
        sequence = facts.get("sequence") or 1
        width_guess = math.sqrt(max(facts["blocks"] or [1]) / 12)
        kv = samples * sequence * width_guess * 2 * 4 / candidate.context
        model_s += blocks * 3 * kv * (candidate.context - 1) / link["bandwidth"]
    return {"data": data_s, "model": model_s}
