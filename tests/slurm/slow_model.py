"""runner's mlp, slowed down on a SLURM job's first start only: each forward pass sleeps
RUNNER_TEST_STEP_DELAY_S seconds until SLURM starts the job again (SLURM_RESTART_COUNT).
The weights are the mlp's: a run that is signalled or requeued mid-way ends as a fast
uninterrupted one does."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from torch import nn

from runner.models.builders import mlp


def mlp_slow_on_first_start(
    input_shape: Sequence[int], num_classes: int, hidden_sizes: Sequence[int] = (128, 64)
) -> nn.Module:
    model = mlp(input_shape, num_classes, hidden_sizes)
    delay = float(os.environ.get("RUNNER_TEST_STEP_DELAY_S", "0"))
    if delay > 0 and not os.environ.get("SLURM_RESTART_COUNT"):
        model.register_forward_pre_hook(lambda *_: time.sleep(delay))
    return model
