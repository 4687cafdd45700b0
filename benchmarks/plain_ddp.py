"""The training script a user would write by hand: the baseline runner is measured against.

    torchrun --standalone --nproc-per-node 2 benchmarks/plain_ddp.py --model resnet18 --grad-accum 4

DDP over gloo, a DataLoader over a DistributedSampler, gradient accumulation
with no_sync, AdamW. Prints one JSON line on rank 0: mean seconds per optimizer
step after `--warmup` steps, when the first step was done (unix time),
optimizer state bytes and peak RSS.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from runner.data.synthetic import synthetic  # the dataset only, none of the machinery


def build_model(name: str) -> torch.nn.Module:
    if name == "mlp":
        return torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Linear(3 * 32 * 32, 128),
            torch.nn.ReLU(),
            torch.nn.Linear(128, 64),
            torch.nn.ReLU(),
            torch.nn.Linear(64, 10),
        )
    import torchvision

    return getattr(torchvision.models, name)(weights=None, num_classes=10)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--grad-accum", type=int, default=1)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    # The same images runner trains on: speed depends on the data (random labels on
    # noise ran about 40% slower here than this learnable set).
    data = synthetic()
    inputs, labels = data.train.inputs, data.train.labels
    per_rank = args.global_batch_size // world
    sampler = DistributedSampler(
        TensorDataset(inputs, labels), shuffle=True, seed=0, drop_last=True
    )
    loader = DataLoader(TensorDataset(inputs, labels), batch_size=per_rank, sampler=sampler)
    model = DistributedDataParallel(build_model(args.model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    params, grad_bytes = list(model.parameters()), 0

    step, epoch, started, first_step_at = 0, 0, time.perf_counter(), None
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            for i, (mx, my) in enumerate(
                zip(x.chunk(args.grad_accum), y.chunk(args.grad_accum), strict=True)
            ):
                last = i == args.grad_accum - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    loss = F.cross_entropy(model(mx), my) / args.grad_accum
                    loss.backward()
            if step == 0:  # gradients peak here: what a rank holds besides weights and state
                grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
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
        state_bytes = sum(
            v.numel() * v.element_size()
            for state in optimizer.state.values()
            for k, v in state.items()
            if torch.is_tensor(v) and k != "step"
        )
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        result = {
            "sec_per_step": seconds,
            "first_step_at": first_step_at,
            "optimizer_state_bytes": state_bytes,
            "state_bytes": param_bytes + grad_bytes + state_bytes,
        }
        print(json.dumps({**result, "peak_rss_bytes": peak_rss, "loss": loss.item()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without interpreter teardown, where torch 2.14's gloo sometimes aborts (SIGABRT
    # after the result is printed), which would end a bench suite; runner's worker does the
    # same. Per-step figures come from differences of walls, so this cancels out.
    sys.stdout.flush()
    os._exit(0)
