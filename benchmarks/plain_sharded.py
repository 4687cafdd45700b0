"""The sharded training script a user would write by hand: FSDP2 or DeepSpeed ZeRO, the
baseline runner's fsdp, zero2 and zero3 are measured against.

    torchrun --standalone --nproc-per-node 2 benchmarks/plain_sharded.py --engine fsdp

runner's gpt on random byte tokens (as plain_ddp.py's --model gpt), fp32, AdamW, one
microbatch per step, a DistributedSampler. fsdp: `fully_shard` on every block, then on the
root (FSDP2's documented recipe). zero2/zero3: `deepspeed.initialize` with the torch
AdamW as its client optimizer and a ZeRO config of the stage, the whole model built first
(as DeepSpeed's examples do). Prints one JSON line on rank 0: mean seconds per optimizer
step after `--warmup` steps, and when the first step was done (unix time).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from plain_ddp import build_model, loss_of  # the same model and loss as the DDP baseline
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def wrap(engine: str, module: torch.nn.Module, args: argparse.Namespace, world: int):
    """(the model to call, a backward-and-step function)."""
    if engine == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in module.blocks:
            fully_shard(block)
        fully_shard(module)
        optimizer = torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=0.01)

        def step(loss: torch.Tensor) -> None:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        return module, step
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    optimizer = torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=0.01)

    config = {
        "train_batch_size": args.global_batch_size,
        "train_micro_batch_size_per_gpu": args.global_batch_size // world,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": int(engine[-1])},
    }
    model, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)

    def ds_step(loss: torch.Tensor) -> None:
        model.backward(loss)
        model.step()

    return model, ds_step


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", default="fsdp", choices=["fsdp", "zero2", "zero3"])
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (2048, args.block_size))
    data = TensorDataset(tokens, tokens)
    sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=args.global_batch_size // world, sampler=sampler)
    model, backward_and_step = wrap(args.engine, build_model("gpt", args), args, world)

    step, epoch, started, first_step_at = 0, 0, time.perf_counter(), None
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = loss_of(model(x), y)
            backward_and_step(loss)
            step += 1
            if first_step_at is None:
                first_step_at = time.time()
            if step == args.warmup:
                started = time.perf_counter()
            if step == args.steps:
                break
        epoch += 1
    if rank == 0:
        seconds = (time.perf_counter() - started) / max(1, args.steps - args.warmup)
        result = {"sec_per_step": seconds, "first_step_at": first_step_at, "loss": loss.item()}
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # as plain_ddp.py: no interpreter teardown (torch 2.14's gloo may abort)
