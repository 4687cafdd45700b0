"""A small GPT on a small text corpus: the arguments and the corpus (a module-scoped fixture)
that the language-model tests share."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import default_collate

from runner.data.datasets import build_datasets
from runner.data.sampler import GlobalBatchSampler
from runner.engines.optim import build_optimizer
from runner.engines.schedules import build_scheduler
from runner.models import build_model
from runner.models.initial_weights import seed_everything
from runner.spec import RunSpec

GLOBAL_BATCH = 12


STEPS = 6


def lm_args(root: Path) -> list[str]:
    return [
        "model=gpt",
        "model.n_layer=2",
        "model.n_head=2",
        "model.n_embd=32",
        "model.bias=false",  # a key bias has a zero gradient that AdamW turns into noise
        "data=text",
        f"data.root={root}",
        "data.block_size=24",
        "data.min_length=3",  # ragged samples, padded per microbatch
        "loss=causal_lm",
        "metrics=language_model",
        "precision=fp32",
        "progress_bar=false",
        "scheduler=constant",
        f"global_batch_size={GLOBAL_BATCH}",
        "max_epochs=null",
        f"max_steps={STEPS}",
        "log_interval=2",
    ]


def train_plain(
    spec: RunSpec,
    naive_microbatches: int = 1,
    grad_norms: list[float] | None = None,
    prepare: Callable[[torch.nn.Module], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Plain PyTorch, one process: each step's loss is the mean over every real token of
    the global batch. naive_microbatches=K averages K per-microbatch token means instead.
    Each step's gradient norm is appended to `grad_norms` when given; `prepare` is called
    with the model once it is built."""
    seed_everything(spec.seed)
    data = build_datasets(spec.data)
    model = build_model(spec.model, data.info)
    if prepare is not None:
        prepare(model)
    optimizer = build_optimizer(spec.optimizer, model)
    scheduler = build_scheduler(spec.scheduler, optimizer, STEPS)
    sampler = GlobalBatchSampler(len(data.train), spec.global_batch_size, 1, 0, seed=spec.seed)
    for indices in list(sampler)[:STEPS]:
        losses = []
        for chunk in torch.tensor(indices).chunk(naive_microbatches):
            collate = data.collate_fn or default_collate  # packed blocks need no padding
            batch = collate([data.train[i] for i in chunk.tolist()])
            out = model(batch["input_ids"], attention_mask=batch.get("attention_mask"))
            logits = getattr(out, "logits", out)  # a Hugging Face model's output, or logits
            losses.append(
                F.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]),
                    batch["labels"][:, 1:].reshape(-1),
                    ignore_index=-100,
                )
            )
        (sum(losses) / len(losses)).backward()
        if grad_norms is not None:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            grad_norms.append(torch.nn.utils.get_total_norm(grads).item())
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
