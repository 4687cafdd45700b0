"""The language-model script a user would write by hand, nanoGPT's way: the baseline runner's
gpt is measured against on a GPU.

    torchrun --standalone --nproc-per-node 1 benchmarks/plain_gpt.py --device cuda \
        --global-batch-size 16 --block-size 1024 [--compile] [--float8 tensorwise]

The tokens live on the device already and each batch is cut from them there (random windows,
as nanoGPT's get_batch cuts its memmap); runner's gpt (the same module), bf16 autocast, fused
AdamW, TF32 matmuls, DDP over nccl when there are several ranks, `.item()` only at the end.
`--engine fsdp`: FSDP2 with bf16 parameters instead of DDP and autocast (torchtitan's way).
Prints one JSON line on rank 0 as plain_ddp.py does: mean seconds per optimizer step after
`--warmup` steps (the device synchronised at both ends of the timed span), when the first
step was done, optimizer state bytes and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from runner.models.gpt import GPT  # the model only, none of the machinery

VOCAB = 256  # bytes: what runner's text data gives the gpt by default


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--device", default="cuda", choices=["cpu", "cuda"])
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-head", type=int, default=12)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--float8", choices=["tensorwise", "rowwise"], default=None)
    # fsdp: FSDP2's documented recipe as torchtitan runs it: fully_shard on every block, then
    # the root, with bf16 parameters and fp32 reductions (MixedPrecisionPolicy), no autocast
    parser.add_argument("--engine", choices=["ddp", "fsdp"], default="ddp")
    # fp32: no autocast (a CPU's bf16 is emulated: what a user there trains in)
    parser.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    args = parser.parse_args()

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (4_000_000,), device=device)
    generator = torch.Generator(device=device).manual_seed(rank)
    per_rank = args.global_batch_size // world
    offsets = torch.arange(args.block_size, device=device)

    def get_batch() -> torch.Tensor:
        starts = torch.randint(
            len(tokens) - args.block_size, (per_rank, 1), device=device, generator=generator
        )
        return tokens[starts + offsets]

    module = GPT(VOCAB, args.block_size, args.n_layer, args.n_head, args.n_embd).to(device)
    if args.float8:  # torchao's float8 training as its README shows, the head left in bf16
        from torchao.float8 import (
            Float8LinearConfig,
            _auto_filter_for_recipe,
            convert_to_float8_training,
        )

        convert_to_float8_training(
            module,
            config=Float8LinearConfig.from_recipe_name(args.float8),
            module_filter_fn=_auto_filter_for_recipe(args.float8, ["lm_head"]),
        )
    if args.engine == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        half = torch.bfloat16 if args.precision == "bf16" else None
        policy = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32)
        for block in module.blocks:
            fully_shard(block, mp_policy=policy)
        model = fully_shard(module, mp_policy=policy)
    else:
        model = DistributedDataParallel(module, device_ids=[device.index] if cuda else None)
    if args.compile:
        model = torch.compile(model)
    optimizer = torch.optim.AdamW(module.parameters(), lr=args.lr, weight_decay=0.01, fused=cuda)

    first_step_at, started = None, time.perf_counter()
    for step in range(1, args.steps + 1):
        x = get_batch()
        autocast = args.engine == "ddp" and args.precision == "bf16"
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(x)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), x[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step in (1, args.warmup, args.steps) and cuda:  # the clock reads finished work
            torch.cuda.synchronize()
        if step == 1:
            first_step_at = time.time()
        if step == args.warmup:
            started = time.perf_counter()
    if rank == 0:
        seconds = (time.perf_counter() - started) / max(1, args.steps - args.warmup)
        state_bytes = sum(
            v.numel() * v.element_size()
            for state in optimizer.state.values()
            for k, v in state.items()
            if torch.is_tensor(v) and k != "step"
        )
        params = sum(p.numel() * p.element_size() for p in module.parameters())
        result = {
            "sec_per_step": seconds,
            "first_step_at": first_step_at,
            "optimizer_state_bytes": state_bytes,
            "state_bytes": 2 * params + state_bytes,  # weights, gradients, AdamW's state
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
            "loss": loss.item(),
        }
        print(json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # as plain_ddp.py: no interpreter teardown
