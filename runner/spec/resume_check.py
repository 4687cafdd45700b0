"""Can this run continue from that checkpoint? Checked in the parent, before any rank starts.

Every checkpoint carries `checkpoint.json` (written by rank 0, sealed by the
manifest like its other files): the settings the saved state depends on and the
names and shapes of the model's state. Resuming must keep what the saved state
or the sample position depends on; the rest (max_steps, intervals, logging,
sync strategy, and for ddp the world size and grad_accum) may change.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from runner.secrets import mask_secret_keys
from runner.spec.convert import to_dict
from runner.spec.schema import DEEPSPEED_SPECS, RunSpec

META_FILE = "checkpoint.json"


def checkpoint_meta(
    spec: RunSpec,
    step: int,
    samples: int,
    world_size: int,
    shapes: list[tuple[str, list[int]]],
    stream: bool = False,
) -> dict[str, Any]:
    """What rank 0 writes into every checkpoint as META_FILE; `stream`: the training data is
    an iterable dataset whose position is kept per rank."""
    return {
        "step": step,
        "samples": samples,
        "world_size": world_size,
        "parallelism": spec.parallelism.name,
        "precision": spec.precision.name.value,
        "weights_dtype": "float32",  # under every precision and parallelism (ZeRO too)
        "optimizer": spec.optimizer.name,
        "global_batch_size": spec.global_batch_size,
        "model_input": _model_input(spec),
        "state_shapes": shapes,
        "data_position": "per_rank" if stream else "step",
    }


def read_meta(checkpoint: Path) -> dict[str, Any] | None:
    try:
        return json.loads((checkpoint / META_FILE).read_text())
    except (OSError, ValueError):
        return None


def check_resume(spec: RunSpec, checkpoint: Path) -> list[str]:
    """Problems with resuming `spec` from `checkpoint` (a valid checkpoint directory)."""
    meta = read_meta(checkpoint)
    if meta is None:
        return [f"resume: {checkpoint} has no readable {META_FILE}; it was not written by runner"]
    saved = f"the checkpoint {checkpoint}"
    problems = []
    kept = [
        (
            "parallelism",
            _reader(spec.parallelism.name, meta.get("parallelism")),
            "checkpoints convert between ddp and fsdp only, at any mesh; ZeRO reads and "
            "writes its own",
        ),
        ("optimizer", spec.optimizer.name, "the optimizer state is kept"),
        (
            "global_batch_size",
            spec.global_batch_size,
            "a step is one global batch, so the sample position and the schedule depend on it",
        ),
    ]
    if isinstance(spec.parallelism, DEEPSPEED_SPECS) and "weights_dtype" not in meta:
        kept.append(  # written when ZeRO kept bf16/fp16 weights: its state has their layout
            (
                "precision",
                spec.precision.name.value,
                "under ZeRO it kept the weights in that precision then",
            )
        )
    for key, value, why in kept:
        if meta.get(key) != value:
            problems.append(
                f"{key}={value}: {saved} was written with {key}={meta.get(key)}; "
                f"resume with {key}={meta.get(key)} ({why})"
            )
    if meta.get("data_position") == "per_rank" and meta.get("world_size") != spec.world_size:
        problems.append(
            f"nproc x nodes = {spec.world_size}: {saved} was written at world size "
            f"{meta.get('world_size')} with an iterable dataset, whose position is each rank's "
            f"own (its part of the stream); resume it at world size {meta.get('world_size')}"
        )
    if meta.get("model_input") != _model_input(spec):
        try:
            mismatch = _first_mismatch(meta["state_shapes"], _configured_shapes(spec))
        except RuntimeError as exc:
            return [*problems, f"model={spec.model.name}: {exc}"]
        if mismatch:
            problems.append(
                f"model={spec.model.name}: {saved} does not match the configured model; "
                f"first mismatching parameter {mismatch}"
            )
    return problems


def _reader(configured: str, saved: Any) -> str:
    """The parallelism the checkpoint must have been written with for `configured` to read
    it: its own; ddp reads fsdp's DCP shards (tensor-parallel too) whole, and fsdp cuts its
    part from ddp's whole state."""
    return saved if {configured, saved} == {"ddp", "fsdp"} else configured


def _model_input(spec: RunSpec) -> dict[str, Any]:
    """What decides the model's state shapes: equal values mean equal shapes (the data
    component decides what the model is told: num_classes, vocab_size, ...)."""
    return mask_secret_keys({"model": to_dict(spec.model.node), "data": to_dict(spec.data.node)})


def _configured_shapes(spec: RunSpec) -> list[tuple[str, list[int]]]:
    if "torch" in sys.modules:  # already paid for here (an embedding program, a test)
        from runner.models.shapes import configured_state_shapes

        try:
            return configured_state_shapes(spec)
        except Exception as exc:
            raise RuntimeError(f"could not build the configured model: {exc}") from exc
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # meta tensors only; no device needed
    result = subprocess.run(
        [sys.executable, "-m", "runner.models.shapes"],
        input=yaml.safe_dump(to_dict(spec)),
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"could not build the configured model to compare shapes: {tail}")
    return [(name, shape) for name, shape in json.loads(result.stdout)]


def _first_mismatch(
    saved: list[tuple[str, list[int]]], configured: list[tuple[str, list[int]]]
) -> str | None:
    wanted = dict(configured)
    for name, shape in saved:
        if name not in wanted:
            return f"'{name}': in the checkpoint, not in the configured model"
        if list(wanted[name]) != list(shape):
            return f"'{name}': checkpoint {list(shape)}, configured {list(wanted[name])}"
    have = {name for name, _ in saved}
    for name, _ in configured:
        if name not in have:
            return f"'{name}': in the configured model, not in the checkpoint"
    return None
