"""The space-time equivalence yardstick: the reference run's arguments, plain single-process
PyTorch training on whole global batches, and how far two sets of weights are apart."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from runner.data.datasets import build_datasets
from runner.data.sampler import GlobalBatchSampler
from runner.engines.optim import build_optimizer
from runner.engines.schedules import build_scheduler
from runner.models import build_model
from runner.models.initial_weights import seed_everything
from runner.spec import RunSpec
from tests.helpers.cli import FAST

GLOBAL_BATCH = 84  # 1438 digits = 17 x 84 + 10: step 18 trains 10 samples, in uneven microbatches


STEPS = 20  # crosses the epoch boundary


ARGS = [
    *FAST,
    f"global_batch_size={GLOBAL_BATCH}",
    f"max_steps={STEPS}",
    "scheduler=constant",
    "log_interval=5",
]


RTOL = 1e-5


def relative_error(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in a)


def train_plain(
    spec: RunSpec, naive_microbatches: int = 1, grad_norms: list[float] | None = None
) -> dict[str, torch.Tensor]:
    """Plain PyTorch, one process: each step trains on the whole global batch.

    naive_microbatches=K instead averages K per-microbatch mean losses: what a split that
    ignores microbatch sizes computes. It differs only when a microbatch is uneven. Each
    step's gradient norm is appended to `grad_norms` when given.
    """
    seed_everything(spec.seed)
    data = build_datasets(spec.data)
    model = build_model(spec.model, data.info)
    optimizer = build_optimizer(spec.optimizer, model)
    sampler = GlobalBatchSampler(len(data.train), spec.global_batch_size, 1, 0, seed=spec.seed)
    steps = spec.max_steps
    assert steps is not None, "the reference trains a fixed number of steps"
    scheduler = build_scheduler(spec.scheduler, optimizer, steps)
    step = 0
    while step < steps:
        sampler.set_epoch(step // sampler.steps_per_epoch)
        for (indices,) in zip(sampler, strict=False):
            inputs, labels = data.train.batch(indices)
            chunks = np.array_split(np.arange(len(indices)), naive_microbatches)
            loss = sum(F.cross_entropy(model(inputs[c]), labels[c]) for c in chunks) / len(chunks)
            loss.backward()
            if grad_norms is not None:
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                grad_norms.append(torch.nn.utils.get_total_norm(grads).item())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step += 1
            if step == steps:
                break
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# The small models' parameters are all under DeepSpeed's persistence threshold (1e5
# elements), which would keep every one whole on every rank: partition them all, and step
# them in several sub-groups (one per 2000 elements or so), as a large model's are.
ENGINE_OPTIONS = {
    "zero3": ["parallelism.param_persistence_threshold=0", "parallelism.sub_group_size=2000"]
}
