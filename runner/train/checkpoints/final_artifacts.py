"""Stage 8 on a completed run: model.pt and summary.json, written by rank 0 after every
rank has checked its weights and told its memory.

model.pt is one plain fp32 `state_dict`, whatever the parallelism (gathered from ZeRO's
partitions and FSDP's shards one tensor at a time: runner.train.checkpoints.weights_file), and
model.safetensors the same tensors in the safe format, copied from it one at a time.
summary.json comes last: a run with a `completed` summary has all its artifacts.
"""

from __future__ import annotations

from typing import Any

from runner import dist as rdist
from runner.engines.base import Engine
from runner.hardware import library_rss_bytes, peak_rss_bytes
from runner.models.safetensors_out import safetensors_beside
from runner.rundir.files import RunDir
from runner.rundir.summary import Status, attempts, build_summary, history, write_summary
from runner.spec import RunSpec
from runner.train.checkpoints.weights_file import write_weights


def peak_device_bytes(device: str) -> int | None:
    """The most bytes this rank's CUDA device had allocated (None on a CPU)."""
    if device != "cuda":
        return None
    import torch

    return int(torch.cuda.max_memory_allocated())


def write_final(
    run_dir: RunDir,
    spec: RunSpec,
    engine: Engine,
    records: list[dict[str, Any]],
    rss: tuple[int, int, int],
    weights: bool = True,
    status: Status = Status.COMPLETED,
    **facts: Any,
) -> dict[str, Any]:
    """Every rank: gather the weights and each rank's memory; rank 0: write model.pt, then
    summary.json with `facts` (start_time, restarts, resumed_from, first_step_at,
    compile_s, the microbatching keys). `rss`: this rank's resident memory before it built
    anything (its base), the library pages of it (hardware.library_rss_bytes), its peak
    before its first step; the base reported counts the library pages it mapped since (its
    kernels' code: shared). Returns the summary (empty on other ranks)."""
    base_rss, base_library_rss, build_peak = rss
    base_rss += max(0, library_rss_bytes() - base_library_rss)  # before writing the weights
    if weights:  # not after eval_only: the weights are the ones it started from
        write_weights(run_dir.model, engine.final_tensors())
        if rdist.get_global_rank() == 0:
            safetensors_beside(run_dir.model)  # the same weights, without pickle
    memory = (engine.state_bytes(), peak_rss_bytes(), base_rss, build_peak)
    memory += (peak_device_bytes(spec.device),)
    per_rank = rdist.all_gather_object(memory)
    if rdist.get_global_rank() != 0:
        return {}
    start_time = facts.pop("start_time")
    summary = build_summary(
        status,
        rdist.get_world_size(),
        start_time,
        records,
        state_bytes=[rank[0] for rank in per_rank],
        peak_rss_bytes=[rank[1] for rank in per_rank],
        base_rss_bytes=[rank[2] for rank in per_rank],
        build_peak_rss_bytes=[rank[3] for rank in per_rank],
        peak_device_bytes=[rank[4] for rank in per_rank] if spec.device == "cuda" else None,
        nodes=spec.nodes,
        nproc=spec.nproc,
        device=spec.device,
        parallelism=spec.parallelism.name,
        precision=spec.precision.name.value,
        **facts,
        attempts=attempts(run_dir),
        history=history(run_dir),
    )
    write_summary(run_dir, summary)  # last: a summary means the run is complete
    return summary
