"""grad_accum=auto against a real CUDA out-of-memory error. Run alone (tests/gpu/suite.py runs
it after the rest): it sizes its allocation from the memory free on the GPU, which tests
running beside it would change."""

from __future__ import annotations

import pytest

from tests.helpers.gpu_runs import GPU

pytestmark = pytest.mark.gpu_alone


def test_grad_accum_auto_recovers_from_a_real_out_of_memory_error(cli):
    batch = 256
    run = cli("model=custom", "model._target_=tests.gpu.memory_hog.MemoryHog",
              f"+model.batch={batch}", "data=synthetic", f"global_batch_size={batch}",
              "grad_accum=auto", *GPU, "max_steps=3", "progress_bar=false",
              "metrics=none")  # fmt: skip
    assert run.returncode == 0, run.output
    summary = run.summary()
    accum, micro = summary["grad_accum"], summary["micro_batch_size"]
    # halved until it fit: once where the free memory held steady (1.5x free, then 0.75x)
    assert accum >= 2 and accum & (accum - 1) == 0 and micro * accum == batch, summary
    assert summary["microbatch_retries"][0]["step"] == 1
    assert "CUDA out of memory" in run.rank_log(0)
