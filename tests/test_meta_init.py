"""Models bigger than one rank: under fsdp and zero3 the ranks build the model without its
weights and fill in only their own shards from the seed weights the launcher wrote. The
weights are those of a run that built the whole model on every rank, bit for bit."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from runner.models.initial_weights import build_data_and_model
from runner.spec import load_spec, resolve_spec
from runner.train.build.sharded_init import build_for_rank
from tests.helpers.cli import FAST, MATRIX
from tests.helpers.config import compose_config
from tests.helpers.language_model import lm_args

CASES = {
    "fsdp": ["parallelism=fsdp"],
    "hsdp": ["parallelism=fsdp", "parallelism.replicate=2", "nproc=4"],
    "zero3": ["parallelism=zero3"],  # small parameters kept whole too (persistence threshold)
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=MATRIX) if c == "hsdp" else c for c in CASES]
)  # hsdp: fsdp's sharding twice over (make test-matrix)
def test_meta_init_trains_the_whole_builds_weights_bit_for_bit(
    cli, corpus: Path, case: str
) -> None:
    args = [*lm_args(corpus), *CASES[case]]
    meta = cli(*args, name="meta")
    whole = cli(*args, "parallelism.meta_init=false", name="whole")
    assert meta.returncode == 0 and whole.returncode == 0, meta.output + whole.output
    assert "meta_init: each rank holds only its shards" in meta.rank_log(0)
    assert "meta_init" not in whole.rank_log(0)
    for run in (meta, whole):  # a sharded CPU rank maps its large blocks alone
        assert "heap: blocks of 1 MB or more are mapped on their own" in run.rank_log(1)
    assert "initial weights:" in meta.output and not (whole.run_dir / "init").exists()

    seed = _read(meta.run_dir / "init" / "weights.safetensors")
    _, built = build_data_and_model(load_spec(meta.run_dir))  # as a whole-model rank does
    assert seed.keys() == dict(built.named_parameters()).keys()
    assert all(torch.equal(seed[name], p) for name, p in built.named_parameters())

    a = torch.load(meta.run_dir / "model.pt", weights_only=True)
    b = torch.load(whole.run_dir / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in b)
    assert [r["train/loss"] for r in meta.metrics()] == [r["train/loss"] for r in whole.metrics()]


@pytest.mark.slow
def test_a_model_that_cannot_be_built_on_meta_is_built_whole(cli) -> None:
    result = cli(
        *FAST,
        "parallelism=fsdp",
        "model=custom",
        "model._target_=tests.helpers.meta_models.ReadsItsWeights",
        "max_epochs=null",
        "max_steps=3",
    )
    assert result.returncode == 0, result.output
    log = result.rank_log(0)
    assert "meta_init: tests.helpers.meta_models.ReadsItsWeights cannot be built" in log
    assert "every rank builds the whole model instead" in log


def _read(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _spec(*overrides: str):
    return resolve_spec(compose_config([*FAST, "device=cpu", *overrides]))


def test_fsdp_builds_on_the_meta_device_and_names_what_it_cannot(tmp_path: Path) -> None:
    """What each rank builds: shapes only, and a fill for later; or, for a model that keeps a
    tensor outside its parameters and buffers, the whole model (it would stay on meta)."""
    spec = _spec("parallelism=fsdp")
    _, module, fill = build_for_rank(spec, "cpu", tmp_path / "weights.safetensors")
    assert fill is not None and all(p.is_meta for p in module.parameters())

    stray = "model._target_=tests.helpers.meta_models.KeepsAStrayTensor"
    _, module, fill = build_for_rank(
        _spec("parallelism=fsdp", "model=custom", stray), "cpu", tmp_path
    )
    assert fill is None and not any(p.is_meta for p in module.parameters())

    whole = dataclasses.replace(
        spec, parallelism=dataclasses.replace(spec.parallelism, meta_init=False)
    )
    _, module, fill = build_for_rank(whole, "cpu", tmp_path)
    assert fill is None and not any(p.is_meta for p in module.parameters())
