"""Every shipped config composes and resolves into a valid RunSpec (no ranks started)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from runner.spec import RunSpec, SyncStrategy, load_spec, resolve_spec, save_spec, to_dict
from tests.helpers.cli import CONF_DIR
from tests.helpers.config import compose_config

# Every config group that ships (conf/<group>/), Hydra's own and recipes aside.
GROUPS = sorted(
    p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name not in ("hydra", "recipe")
)
COMPONENT_GROUPS = ("model", "data", "loss", "optimizer", "scheduler")


def test_rerun_picks_an_option_of_every_group() -> None:
    from runner.cli.rerun import GROUPS as RERUN_GROUPS

    assert sorted(RERUN_GROUPS) == GROUPS


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.fixture
def image_roots(tmp_path: Path) -> dict[str, str]:
    """A data.root for each shipped data option that reads files."""
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_text("hello world " * 100)
    folder = tmp_path / "images"
    for split in ("train", "val"):
        (folder / split / "cat").mkdir(parents=True)
    cifar = tmp_path / "cifar" / "cifar-10-batches-py"
    cifar.mkdir(parents=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]:
        (cifar / name).write_bytes(b"")
    (texts / "b.jsonl").write_text('{"text": "hello"}\n')
    return {
        "image_folder": str(folder),
        "cifar10": str(cifar.parent),
        "text": str(texts),
        "hf_text": str(texts / "b.jsonl"),
    }


def test_every_group_has_options() -> None:
    for group in GROUPS:
        assert options(group), f"conf/{group}/ has no options"
    assert options("parallelism") == ["auto", "ddp", "fsdp", "zero1", "zero2", "zero3"]
    assert options("sync_strategy") == [
        "auto",
        "forced_sync",
        "multi_auto_sync",
        "single_auto_sync",
    ]
    assert options("precision") == ["auto", "bf16", "float8", "fp16", "fp32"]


@pytest.mark.parametrize("group", GROUPS)
def test_every_option_composes_and_resolves(group: str, image_roots: dict[str, str]) -> None:
    for option in options(group):
        overrides = [f"{group}={option}", "device=cpu"]
        if group == "data" and option == "hf_text":  # files, and a stream's length
            overrides += [f"data.data_files={image_roots[option]}", "max_steps=10"]
        elif group == "data" and option in image_roots:
            overrides.append(f"data.root={image_roots[option]}")
        if option == "custom":  # the user names the target on the command line
            overrides.append(f"{group}._target_=mypackage.module.Thing")
        if (group, option) == ("parallelism", "auto"):  # planned before it resolves:
            continue  # tests/test_layout_plan.py
        if group == "precision" and option == "fp16":
            spec = resolve_spec(compose_config(overrides[:1]), cuda_devices=2)
            assert spec.device == "cuda"
            continue
        spec = resolve_spec(compose_config(overrides))
        assert isinstance(spec, RunSpec)
        chosen = getattr(spec, group)
        if group in COMPONENT_GROUPS:  # the option's file names the target
            written = OmegaConf.load(CONF_DIR / group / f"{option}.yaml")["_target_"]
            assert chosen.target == (written or "mypackage.module.Thing"), option
            continue
        if group == "metrics":
            assert set(chosen) == set(OmegaConf.load(CONF_DIR / group / f"{option}.yaml"))
            continue
        if group == "logger":  # any number of options; `none` selects no tracker
            assert chosen.selected == ([] if option == "none" else [option])
            continue
        name = chosen.name
        resolved_elsewhere = (group, option) in (("sync_strategy", "auto"), ("precision", "auto"))
        assert getattr(name, "value", name) == option or resolved_elsewhere


def test_every_recipe_composes(image_roots: dict[str, str]) -> None:
    recipes = sorted(p.stem for p in (CONF_DIR / "recipe").glob("*.yaml"))
    assert recipes, "recipes/ is empty"
    for recipe in recipes:
        config = compose_config([f"+recipe={recipe}", "device=cpu"])
        root = image_roots.get(config["data"]["_target_"].rsplit(".", 1)[-1])
        overrides = [f"data.root={root}"] if root else []
        resolve_spec(compose_config([f"+recipe={recipe}", "device=cpu", *overrides]))


def test_default_config_resolves_autos() -> None:
    spec = resolve_spec(compose_config([]))
    assert spec.device in ("cpu", "cuda")
    assert spec.sync_strategy.name is SyncStrategy.SINGLE_AUTO_SYNC
    unused = resolve_spec(compose_config(["parallelism.find_unused_parameters=true", "device=cpu"]))
    assert unused.sync_strategy.name is SyncStrategy.MULTI_AUTO_SYNC
    auto = resolve_spec(compose_config(["nproc=auto", "device=cpu"]))
    assert isinstance(auto.nproc, int) and auto.nproc >= 1


def test_spec_round_trips_through_config_yaml(tmp_path: Path) -> None:
    spec = resolve_spec(compose_config(["model=resnet18", "optimizer=sgd", "device=cpu"]))
    save_spec(spec, tmp_path)
    text = (tmp_path / "config.yaml").read_text()
    assert "${" not in text
    assert load_spec(tmp_path) == spec


def test_command_line_beats_recipe() -> None:
    spec = resolve_spec(
        compose_config(["+recipe=mlp_digits", "nproc=1", "optimizer=sgd", "device=cpu"])
    )
    assert spec.nproc == 1 and spec.optimizer.name == "sgd"


def test_command_line_beats_the_recipe() -> None:
    config = compose_config(["+recipe=resnet50", "parallelism=zero2", "nproc=8", "data.root=/x"])
    assert config["parallelism"]["name"] == "zero2" and config["nproc"] == 8
    assert config["model"]["_target_"].endswith(".resnet50")  # the rest of the recipe applies
    assert config["optimizer"]["momentum"] == 0.875


def test_fsdp_keeps_a_copy_per_node_unless_told() -> None:
    """parallelism.replicate=null resolves to nodes (HSDP across nodes, FSDP on one), and the
    spec written to the run directory says what ran; checkpoint.async is `async` in YAML."""
    one = resolve_spec(compose_config(["parallelism=fsdp", "nproc=4"]))
    assert one.parallelism.replicate == 1
    two = ["parallelism=fsdp", "nproc=4", "nodes=2", "master_port=29500"]
    assert resolve_spec(compose_config(two)).parallelism.replicate == 2
    told = resolve_spec(compose_config([*two, "parallelism.replicate=1"]))
    assert told.parallelism.replicate == 1
    spec = resolve_spec(compose_config(["checkpoint.async=true"]))
    assert spec.checkpoint.async_ and to_dict(spec)["checkpoint"]["async"] is True
    assert resolve_spec(to_dict(spec)) == spec
