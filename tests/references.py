"""Plain PyTorch references as fixtures for tests outside the equivalence modules: the mlp
of tests/test_equivalence.py (ARGS) and the gpt of tests/test_lm_equivalence.py (lm_args),
trained in one process on whole global batches. Import the fixtures by name."""

from __future__ import annotations

import pytest
import torch

from runner.spec import resolve_spec
from tests import test_equivalence as mlp_equivalence
from tests import test_lm_equivalence as lm_equivalence
from tests.test_compose import compose_config
from tests.test_equivalence import ARGS
from tests.test_lm_equivalence import corpus, lm_args

__all__ = ["corpus", "lm_reference", "mlp_reference"]


@pytest.fixture(scope="module")
def mlp_reference() -> dict[str, torch.Tensor]:
    spec = resolve_spec(compose_config([*ARGS, "nproc=1", "device=cpu"]))
    return mlp_equivalence.train_plain(spec)


@pytest.fixture(scope="module")
def lm_reference(corpus) -> dict[str, torch.Tensor]:  # noqa: F811
    spec = resolve_spec(compose_config([*lm_args(corpus), "nproc=1", "device=cpu"]))
    return lm_equivalence.train_plain(spec)
