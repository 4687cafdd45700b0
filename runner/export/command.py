"""`runner export RUN_DIR|CHECKPOINT --to DIR [--dtype fp32|bf16|fp16] [--max-shard-size 5GB]`:
a run's weights as safetensors, sharded with an index above the size, under the names and
with the files beside them that the model's family says (runner.models.families: for a
Hugging Face model its config.json too, so that `AutoModel*.from_pretrained(DIR)` loads
them).

The weights come from a finished run's model.pt, or from any parallelism's checkpoint
(runner.models.checkpoint_weights), and are written one tensor at a time
(runner.models.safetensors_out).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from runner.spec import RunSpec

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20,
         "GIB": 2**30}  # fmt: skip


def shard_bytes(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a number of bytes."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]I?B|B)?\s*", text.upper())
    if not found or float(found.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a size such as 5GB, 500MB or 2GiB")
    return int(float(found.group(1)) * UNITS[found.group(2) or ""])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="runner export",
        description="Write a run's weights as safetensors (with config.json for a Hugging "
        "Face model), from its model.pt or any checkpoint.",
    )
    p.add_argument(
        "source", type=Path, help="a run directory, a checkpoints/step_N directory or a model.pt"
    )
    p.add_argument("--to", type=Path, required=True, help="the directory to write")
    p.add_argument(
        "--dtype", choices=sorted(DTYPES), help="convert floating tensors (default: as stored)"
    )
    p.add_argument(
        "--max-shard-size",
        type=shard_bytes,
        default=shard_bytes("5GB"),
        help="shard above this size, with model.safetensors.index.json (default 5GB)",
    )
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    import torch

    from runner.models.checkpoint_weights import NoWeights, find_weights
    from runner.models.families import Family, family_of
    from runner.models.safetensors_out import OutTensor, write_safetensors
    from runner.spec import load_spec

    try:
        weights = find_weights(args.source)
    except NoWeights as exc:
        print(f"runner export: {exc}", file=sys.stderr)
        return 2
    config = weights.run_dir / "config.yaml"
    spec = load_spec(weights.run_dir) if config.is_file() else None
    module = built_shapes(spec) if spec is not None else None
    family = family_of(module) if module is not None else Family()  # its files, its names
    dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
    tensors = []
    for tensor in weights.tensors:
        if dtype is not None and tensor.dtype.is_floating_point:
            read = tensor.values
            tensor = OutTensor(tensor.name, tensor.shape, dtype, lambda r=read: r().to(dtype))
        tensors.append(tensor)
    if module is not None:
        tensors = family.exported(module, tensors)
    written = write_safetensors(args.to, tensors, args.max_shard_size)
    if module is not None and spec is not None:
        written += family.export_beside(module, spec, args.to)
    size = sum(t.nbytes for t in tensors) / 2**20
    kind = family.export_kind
    print(
        f"runner export: {weights.source} -> {args.to}: {len(tensors)} tensors, {size:.1f} MB "
        f"in {len(written)} file(s){kind}"
    )
    return 0


def built_shapes(spec: RunSpec) -> nn.Module | None:
    """The run's model on the meta device (shapes only); None when it needs what only the
    data reports (an argument such as num_classes), or cannot be built on meta."""
    import torch

    from runner.models.builders import build_model

    try:
        with torch.device("meta"):
            return build_model(spec.model, {})
    except Exception:
        return None
