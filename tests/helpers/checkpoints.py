"""A checkpoint's metadata as rank 0 writes it, without training (the resume checks' input)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from runner.data.datasets import build_datasets
from runner.models import build_model
from runner.models.shapes import state_shapes
from runner.rundir.checkpoints import CheckpointStore
from runner.spec import resolve_spec
from runner.spec.resume_check import META_FILE, checkpoint_meta
from tests.helpers.config import compose_config


def save_checkpoint(
    run_dir: Path, overrides: list[str], world_size: int = 2, without: tuple[str, ...] = ()
) -> Path:
    """A checkpoint's metadata as rank 0 writes it, for the model `overrides` configure;
    `without`: keys left out (as an older runner wrote it)."""
    spec = resolve_spec(compose_config(overrides))
    with torch.device("meta"):
        module = build_model(spec.model, build_datasets(spec.data).info)
    store = CheckpointStore(run_dir / "checkpoints", keep=2)
    partial = store.begin(4)
    meta = checkpoint_meta(spec, 4, 256, world_size, state_shapes(module))
    for key in without:
        del meta[key]
    (partial / META_FILE).write_text(json.dumps(meta))
    return store.commit(4)
