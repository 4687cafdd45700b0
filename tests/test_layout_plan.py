"""parallelism=auto and `runner plan`: the candidates, the prediction against what runner
measures, the pick, the budget, and the checks a hand-given layout meets too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from runner.layouts.candidates import Candidate, candidates
from runner.spec import SpecError, resolve_spec
from runner.spec.plan_specs import parse_size
from tests.helpers.cli import run_cli, run_sweep
from tests.helpers.config import compose_config
from tests.helpers.language_model import lm_args

# The small gpt of the language-model tests, with a batch that divides many ways.
GPT = ["progress_bar=false", "logger=none", "global_batch_size=8", "max_steps=3"]


def test_sizes_are_read_as_a_user_writes_them() -> None:
    assert parse_size("300MB") == 300 * 2**20
    assert parse_size("2GB") == parse_size("2GiB") == parse_size("2 gb") == 2 * 2**30
    assert parse_size("1.5GB") == int(1.5 * 2**30)
    assert parse_size(4096) == parse_size("4096") == 4096
    assert parse_size("lots") is None and parse_size("0MB") is None and parse_size(-1) is None


def test_a_size_that_is_not_one_is_refused_naming_the_key() -> None:
    with pytest.raises(SpecError) as err:
        resolve_spec(compose_config(["plan.memory_per_rank=300 megs", "device=cpu"]))
    assert "plan.memory_per_rank=300 megs: not a size" in str(err.value)


def test_the_candidates_divide_the_ranks_the_heads_and_the_batch() -> None:
    listed = candidates(
        nproc=4, nodes=1, global_batch=16, blocks=4, heads=6, sequence=128, model_splits=True
    )
    meshes = {(c.engine, c.tensor, c.pipeline, c.context) for c in listed}
    assert {("ddp", 1, 1, 1), ("zero3", 1, 1, 1), ("fsdp", 2, 1, 1), ("fsdp", 1, 4, 1)} <= meshes
    assert not any(c.tensor == 4 for c in listed)  # 4 does not divide 6 heads
    assert not any(c.context > 1 for c in listed)  # 128 tokens: not long
    ddp = {c.grad_accum for c in listed if c.engine == "ddp" and c.checkpointing == "none"}
    assert ddp == {1, 2, 4}  # 16 samples over 4 data ranks: 4 each
    tp2 = {
        c.grad_accum for c in listed if (c.tensor, c.pipeline, c.checkpointing) == (2, 1, "full")
    }
    assert tp2 == {1, 2, 4, 8}  # 2 data ranks: 8 samples each
    several = candidates(
        nproc=2, nodes=2, global_batch=8, blocks=0, heads=None, sequence=None, model_splits=False
    )
    assert {c.checkpointing for c in several} == {"none"}  # no blocks to checkpoint
    assert any(c.replicate == 1 for c in several)  # across nodes: fsdp over every rank too
    long = candidates(
        nproc=2, nodes=1, global_batch=8, blocks=2, heads=2, sequence=4096, model_splits=True
    )
    assert any(c.context == 2 for c in long)


def test_a_candidate_is_the_keys_a_user_gives() -> None:
    mesh = Candidate("fsdp", "selective", 4, tensor=2, pipeline=2)
    assert mesh.overrides() == {
        "parallelism": "fsdp",
        "parallelism.tensor": 2,
        "parallelism.pipeline": 2,
        "activation_checkpointing": "selective",
        "grad_accum": 4,
    }
    assert mesh.name == "fsdp tp2 pp2 ac=selective accum=4"


@pytest.mark.slow
def test_runner_plan_prints_the_plan_and_trains_nothing(tmp_path: Path, corpus: Path) -> None:
    result = run_cli(tmp_path, "plan", *lm_args(corpus), *GPT, "parallelism=zero2", name="plan")
    assert result.returncode == 0, result.output
    out = result.stdout
    assert "layout plan for 2 rank(s) on cpu" in out and "chosen: " in out
    assert "weighs every layout" in result.output  # parallelism=zero2 was left out
    assert "ddp accum=1" in out and "fsdp tp2" in out  # the gpt splits
    assert not (tmp_path / "plan").exists() and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_auto_trains_the_pick_and_files_it_as_ordinary_keys(tmp_path: Path, corpus: Path) -> None:
    result = run_cli(tmp_path, *lm_args(corpus), *GPT, "parallelism=auto", name="auto")
    assert result.returncode == 0, result.output
    plan = json.loads((result.run_dir / "plan.json").read_text())
    chosen = next(r for r in plan["candidates"] if r["name"] == plan["chosen"])
    assert chosen["valid"] and chosen["fits"]
    assert "chosen: " + plan["chosen"] in result.output
    written = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    assert written["parallelism"]["name"] == chosen["overrides"]["parallelism"]
    assert written["grad_accum"] == chosen["overrides"]["grad_accum"]
    assert written["activation_checkpointing"] == chosen["overrides"]["activation_checkpointing"]
    assert result.summary()["status"] == "completed"
    refused = [r for r in plan["candidates"] if not r["valid"]]
    assert refused and all(r["problems"] for r in refused)
    assert all("predicted" in r for r in plan["candidates"] if r["valid"])


@pytest.mark.slow
def test_a_refused_layout_is_refused_alike_by_hand(tmp_path: Path, corpus: Path) -> None:
    """The planner lists a layout the checks refuse with their words; given by hand, the same
    layout is refused with the same words, before any rank starts: here 2 pipeline stages
    of a gpt of 3 layers (the agent's check of the model)."""
    args = [*lm_args(corpus), *GPT, "model.n_layer=3", "max_steps=1", "data.min_length=null"]
    planned = run_cli(tmp_path, *args, "parallelism=auto", name="auto")
    assert planned.returncode == 0, planned.output
    plan = json.loads((planned.run_dir / "plan.json").read_text())
    staged = [r for r in plan["candidates"] if r["overrides"].get("parallelism.pipeline") == 2]
    refused = next(r for r in staged if r["overrides"]["grad_accum"] == 2)
    assert not refused["valid"] and "do not divide GPT's 3 layers" in refused["problems"][0]
    keys = [f"{k}={v}" for k, v in refused["overrides"].items()]
    by_hand = run_cli(tmp_path, *args, *keys, name="by_hand")
    assert by_hand.returncode == 2
    assert refused["problems"][0] in by_hand.output


@pytest.mark.slow
def test_no_layout_fits_a_budget_too_small(tmp_path: Path, corpus: Path) -> None:
    result = run_cli(
        tmp_path, *lm_args(corpus), *GPT, "parallelism=auto", "plan.memory_per_rank=1KB"
    )
    assert result.returncode == 2
    assert "parallelism=auto: no layout fits 0 MB per rank (plan.memory_per_rank=1KB)" in (
        result.output
    )
    assert "needs " in result.output and "more)" in result.output
    assert not result.run_dir.exists()


@pytest.mark.slow
def test_each_job_of_a_sweep_plans_for_itself(tmp_path: Path, corpus: Path) -> None:
    proc, root = run_sweep(tmp_path, *lm_args(corpus), *GPT, "max_steps=1", "parallelism=auto,ddp")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (root / "0" / "plan.json").is_file() and not (root / "1" / "plan.json").exists()
    assert yaml.safe_load((root / "1" / "config.yaml").read_text())["parallelism"]["name"] == "ddp"
