"""The training script a user would write by hand: the baseline runner is measured against.

    torchrun --standalone --nproc-per-node 2 benchmarks/plain_ddp.py --model resnet18 --grad-accum 4
    torchrun --standalone --nproc-per-node 1 benchmarks/plain_ddp.py --device cuda \
        --model resnet50 --image-size 224 --precision bf16 --channels-last

DDP over gloo (nccl on CUDA), a DataLoader over a DistributedSampler that cuts each batch
from the in-memory tensors in one indexing op (`__getitems__`; pinned on CUDA), as runner's
loader does, gradient accumulation with no_sync, AdamW. Prints one JSON line on rank 0:
mean seconds per optimizer step after `--warmup` steps, when the first step was done (unix
time), optimizer state bytes and peak RSS. `--model gpt` trains runner's gpt on random byte
tokens (next-token loss), the same shapes runner's text data gives it.
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


def build_model(name: str, args: argparse.Namespace) -> torch.nn.Module:
    if name == "gpt":
        from runner.models.gpt import GPT

        return GPT(256, args.block_size, args.n_layer, args.n_head, args.n_embd)
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


class Batched(TensorDataset):
    """A whole batch in one indexing op per tensor (torch's fetcher calls __getitems__ with
    the batch's indices), not one sample at a time stacked by collate: at 224px a per-sample
    collate of 128 images was the step's bottleneck, which runner's loader does not have."""

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        index = torch.as_tensor(indices)
        return [tensor[index] for tensor in self.tensors]


def _whole(batch: list[torch.Tensor]) -> list[torch.Tensor]:
    return batch


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if logits.dim() == 3:  # a language model: every position predicts the next token
        vocab = logits.shape[-1]
        return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), targets[:, 1:].reshape(-1))
    return F.cross_entropy(logits, targets)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--global-batch-size", type=int, default=64)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--channels-last", action="store_true")
    # NVIDIA DeepLearningExamples' synthetic input: one random batch made on the device once
    parser.add_argument("--data-on-device", action="store_true")
    parser.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--block-size", type=int, default=1024)  # gpt
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-head", type=int, default=12)
    parser.add_argument("--n-embd", type=int, default=768)
    args = parser.parse_args()

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    if args.model == "gpt":  # random bytes: inputs and their next-token targets
        tokens = torch.randint(0, 256, (2048, args.block_size))
        inputs, labels = tokens, tokens
    else:
        # The same images runner trains on: speed depends on the data (random labels on
        # noise ran about 40% slower here than this learnable set).
        data = synthetic(image_size=args.image_size)
        inputs, labels = data.train.inputs, data.train.labels
    per_rank = args.global_batch_size // world
    dataset = Batched(inputs, labels)
    sampler = DistributedSampler(dataset, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(
        dataset, batch_size=per_rank, sampler=sampler, pin_memory=cuda, collate_fn=_whole
    )
    module = build_model(args.model, args).to(device)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    module = module.to(memory_format=memory_format)
    model = DistributedDataParallel(module, device_ids=[device.index] if cuda else None)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    if args.optimizer == "sgd":  # no momentum, no weight decay: the plainest step
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    params, grad_bytes = list(model.parameters()), 0

    if args.data_on_device and inputs.dim() == 4:  # images: one batch, every step, no copy
        shape = (per_rank, *inputs.shape[1:])
        fixed = torch.randn(shape, device=device).contiguous(memory_format=memory_format)
        targets = torch.randint(0, int(labels.max()) + 1, (per_rank,), device=device)
        loader = [(fixed, targets)] * len(loader)
    step, epoch, started, first_step_at = 0, 0, time.perf_counter(), None
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if x.dim() == 4:
                x = x.contiguous(memory_format=memory_format)
            for i, (mx, my) in enumerate(
                zip(x.chunk(args.grad_accum), y.chunk(args.grad_accum), strict=True)
            ):
                last = i == args.grad_accum - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    with autocast:
                        logits = model(mx)
                    loss = loss_of(logits, my) / args.grad_accum
                    loss.backward()
            if step == 0:  # gradients peak here: what a rank holds besides weights and state
                grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in params)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if cuda and step in (1, args.warmup, args.steps):  # the clock reads finished work
                torch.cuda.synchronize()
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
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
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
