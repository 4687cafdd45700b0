"""A checkpoint that cannot continue this run is rejected in the parent, naming what differs."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.data.datasets import build_datasets
from runner.models import build_model
from runner.models.shapes import configured_state_shapes, state_shapes
from runner.spec import SpecError, resolve_spec
from tests.helpers.checkpoints import save_checkpoint
from tests.helpers.config import compose_config

MLP = ["model=mlp", "data=digits", "device=cpu"]
RESNET = ["model=resnet18", "data=synthetic", "device=cpu"]


def resume_problems(checkpoint: Path, overrides: list[str]) -> list[str]:
    with pytest.raises(SpecError) as info:
        resolve_spec(compose_config([*overrides, f"resume={checkpoint}"]))
    return info.value.problems


@pytest.mark.parametrize("parallelism", ["ddp", "zero2", "zero3", "fsdp"])
def test_checkpoint_resumes_at_another_world_size_and_split(
    tmp_path: Path, parallelism: str
) -> None:
    overrides = [*MLP, f"parallelism={parallelism}"]
    checkpoint = save_checkpoint(tmp_path / "run", overrides)
    for split in (["nproc=1", "grad_accum=2"], ["nproc=4", "grad_accum=1"]):
        spec = resolve_spec(compose_config([*overrides, *split, f"resume={checkpoint}"]))
        assert spec.resume == str(checkpoint)


def test_ddp_and_fsdp_read_each_others_checkpoints_and_zero_only_its_own(tmp_path: Path) -> None:
    written = {}
    for saved, configured in (("ddp", "fsdp"), ("fsdp", "ddp")):
        written[saved] = save_checkpoint(tmp_path / saved, [*MLP, f"parallelism={saved}"])
        spec = resolve_spec(
            compose_config([*MLP, f"parallelism={configured}", f"resume={written[saved]}"])
        )
        assert spec.resume == str(written[saved])
    checkpoint = save_checkpoint(tmp_path / "zero2", [*MLP, "parallelism=zero2"])
    (problem,) = resume_problems(checkpoint, [*MLP, "parallelism=ddp"])
    assert problem.startswith("parallelism=ddp: the checkpoint")
    assert "resume with parallelism=zero2 (checkpoints convert between ddp and fsdp" in problem
    (problem,) = resume_problems(written["ddp"], [*MLP, "parallelism=zero2"])
    assert "resume with parallelism=ddp" in problem


def test_zero_checkpoint_resumes_at_another_precision(tmp_path: Path) -> None:
    """ZeRO keeps fp32 weights in every precision, as ddp and fsdp do; a checkpoint written
    when it kept 16-bit ones (its meta names no weights_dtype) must keep its precision."""
    checkpoint = save_checkpoint(tmp_path / "run", [*MLP, "parallelism=zero3"])
    spec = resolve_spec(
        compose_config([*MLP, "parallelism=zero3", "precision=bf16", f"resume={checkpoint}"])
    )
    assert spec.resume == str(checkpoint)
    older = [*MLP, "parallelism=zero3"]
    checkpoint = save_checkpoint(tmp_path / "older", older, without=("weights_dtype",))
    (problem,) = resume_problems(checkpoint, [*MLP, "parallelism=zero3", "precision=bf16"])
    assert problem.startswith("precision=bf16: the checkpoint")
    assert "resume with precision=fp32" in problem


def test_settings_the_state_depends_on_must_match(tmp_path: Path) -> None:
    checkpoint = save_checkpoint(tmp_path / "run", MLP)
    found = resume_problems(
        checkpoint, [*MLP, "parallelism=zero1", "optimizer=sgd", "global_batch_size=128"]
    )
    assert [p.split(":")[0] for p in found] == [
        "parallelism=zero1",
        "optimizer=sgd",
        "global_batch_size=128",
    ]
    assert "written with global_batch_size=64; resume with global_batch_size=64" in found[2]


@pytest.mark.parametrize(
    ("saved", "configured", "mismatch"),
    [
        (
            MLP,
            [*MLP, "model.hidden_sizes=[32,64]"],
            "'1.weight': checkpoint [128, 64], configured [32, 64]",
        ),
        (
            MLP,
            [*MLP, "model.hidden_sizes=[128]"],
            "'3.weight': checkpoint [64, 128], configured [10, 128]",
        ),
        (
            RESNET,
            [*RESNET, "data.num_classes=5"],
            "'fc.weight': checkpoint [10, 512], configured [5, 512]",
        ),
        (MLP, RESNET, "'1.weight': in the checkpoint, not in the configured model"),
    ],
)
def test_a_different_model_names_the_first_mismatching_parameter(
    tmp_path: Path, saved: list[str], configured: list[str], mismatch: str
) -> None:
    checkpoint = save_checkpoint(tmp_path / "run", saved)
    (problem,) = resume_problems(checkpoint, configured)
    assert problem.endswith(f"first mismatching parameter {mismatch}"), problem


def test_same_shapes_from_another_spec_are_accepted(tmp_path: Path) -> None:
    checkpoint = save_checkpoint(tmp_path / "run", [*RESNET, "model.zero_init_residual=false"])
    resolve_spec(compose_config([*RESNET, "model.zero_init_residual=true", f"resume={checkpoint}"]))


def test_run_directory_with_checkpoints_needs_resume(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    save_checkpoint(run_dir, MLP)
    with pytest.raises(SpecError) as info:
        resolve_spec(compose_config(MLP), run_dir=run_dir)
    (problem,) = info.value.problems
    assert problem.startswith(f"resume=null: the run directory {run_dir} already holds a run")
    assert "use resume=auto to continue it" in problem
    spec = resolve_spec(compose_config([*MLP, "resume=auto"]), run_dir=run_dir)
    assert spec.resume == "auto"
    with pytest.raises(SpecError, match="first mismatching parameter '1.weight'"):
        resolve_spec(
            compose_config([*MLP, "resume=auto", "model.hidden_sizes=[8]"]), run_dir=run_dir
        )


def test_meta_device_shapes_match_a_real_model() -> None:
    spec = resolve_spec(compose_config(RESNET))
    real = build_model(spec.model, build_datasets(spec.data).info)
    assert configured_state_shapes(spec) == state_shapes(real)
