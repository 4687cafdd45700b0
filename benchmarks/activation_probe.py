"""Peak activation memory of one training step, counted tensor by tensor (not RSS).

    python benchmarks/activation_probe.py --ranks 2 OVERRIDE...

Builds the model the overrides configure with runner's own code (its data's vocabulary,
its activation checkpointing per block), and runs one step of a rank's microbatch (global
batch / ranks / grad_accum sequences) twice: the first makes the gradients, the second is
watched by a dispatch mode that adds up every tensor storage an operation creates and
takes it off when the storage is freed. Its peak is the step's activations and
temporaries (the weights, their gradients and the optimizer state were there before it
began), exactly and the same every time: what checkpointing changes, without the
allocator's slack that peak RSS also counts. Prints one JSON line.

    torchrun --nproc-per-node C benchmarks/activation_probe.py --ranks 1 --context C ...

splits the sequence across the C processes as parallelism.context does
(runner.models.context_split: each its head and tail of the sequence, every position's keys
and values gathered) and prints rank 0's peak.
"""

from __future__ import annotations

import argparse
import json
import weakref
from pathlib import Path
from typing import Any

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from runner.data.datasets import build_datasets
from runner.models import build_model
from runner.models.blocks import apply_activation_checkpointing
from runner.spec import resolve_spec

CONF = Path(__file__).resolve().parent.parent / "conf"


class LiveBytes(TorchDispatchMode):
    """The bytes of the tensor storages created under it and still alive, and their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.now = self.peak = 0

    def _note(self, value: Any) -> None:
        if not isinstance(value, torch.Tensor):
            return
        storage = value.untyped_storage()
        key = storage.data_ptr()
        if key in self.sizes or not storage.nbytes():
            return
        self.sizes[key] = storage.nbytes()
        self.now += storage.nbytes()
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._freed, key)

    def _freed(self, key: int) -> None:
        self.now -= self.sizes.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tree_map(self._note, out)
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--ranks", type=int, required=True)
    parser.add_argument("--context", type=int, default=1, help="processes splitting a sequence")
    parser.add_argument("overrides", nargs="*")
    options = parser.parse_args()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        config = compose(config_name="config", overrides=[*options.overrides, "device=cpu"])
    spec = resolve_spec(OmegaConf.to_container(config, resolve=True))
    info = build_datasets(spec.data).info
    torch.manual_seed(spec.seed)
    model = build_model(spec.model, info)
    if spec.checkpoint_every:
        selective = spec.activation_checkpointing == "selective"
        apply_activation_checkpointing(model, spec.checkpoint_every, selective)
    sequences = spec.global_batch_size // options.ranks // int(spec.grad_accum)
    tokens = torch.randint(0, info["vocab_size"], (sequences, info["block_size"]))
    split = None
    if options.context > 1:
        import torch.distributed as dist

        from runner.models.context_split import apply_context

        dist.init_process_group("gloo")
        apply_context(model, dist.group.WORLD, dist.get_rank(), options.context, -100)
        split = model.context

    def step() -> None:
        logits = model(tokens)
        targets = tokens
        if split is not None:  # this rank's positions, each with the token after it
            logits, targets = split.local(logits, tokens)
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), targets[:, 1:].reshape(-1)
        )
        loss.backward()

    step()  # the gradients exist from here on, as in any step after the first
    watch = LiveBytes()
    with watch:
        step()
    if split is None or torch.distributed.get_rank() == 0:
        print(json.dumps({"peak activations MB/rank": watch.peak / 2**20}))


if __name__ == "__main__":
    main()
