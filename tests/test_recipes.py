"""Every shipped recipe runs (2 steps, 2 ranks, tiny local data in the recipe's layout),
and a run reproduces: `runner rerun RUN_DIR` gives the same losses and weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from runner.data.datasets import build_datasets
from runner.models import build_model
from runner.spec import load_spec
from tests.helpers.cli import REPO
from tests.helpers.datasets import make_cifar10, make_image_folder
from tests.helpers.shared_runs import SharedRuns

pytestmark = pytest.mark.slow
RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
SMOKE = ["nproc=2", "device=cpu", "max_steps=2", "progress_bar=false", "log_interval=1"]


def data_overrides(recipe: str, tmp_path: Path) -> list[str]:
    text = (REPO / "recipes" / f"{recipe}.yaml").read_text()
    data = next(line.split(":")[1].strip() for line in text.splitlines() if "/data:" in line)
    if data == "image_folder":  # ImageNet's layout, tiny images; fewer loader workers
        root = make_image_folder(tmp_path / "imagenet", classes=3, per_class=4, size=40)
        return [f"data.root={root}", "data.num_workers=1", "data.image_size=32"]
    if data == "cifar10":
        return [f"data.root={make_cifar10(tmp_path / 'cifar')}", "data.num_workers=1"]
    return []


def test_every_recipe_is_smoke_tested() -> None:
    assert {"mlp_digits", "resnet18_cifar10", "resnet50"} <= set(RECIPES)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """`smoke(recipe)`: the recipe's run of 2 steps, made once (the rerun test reruns one)."""
    root = tmp_path_factory.mktemp("recipes")
    runs = SharedRuns(root)
    return lambda recipe: runs(f"+recipe={recipe}", *SMOKE, *data_overrides(recipe, root))


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs(smoke, recipe: str) -> None:
    result = smoke(recipe)
    summary = result.summary()
    assert summary["status"] == "completed" and summary["steps"] == 2
    assert summary["world_size"] == 2
    config = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    recipe_text = yaml.safe_load((REPO / "recipes" / f"{recipe}.yaml").read_text())
    assert config["global_batch_size"] == recipe_text["global_batch_size"]  # recipe applied
    assert config["nproc"] == 2  # ... and the command line beat it
    if recipe == "resnet50":  # warmup_epochs=5 with one step per (tiny) epoch: 5 steps
        assert result.metrics()[0]["lr"] == pytest.approx(2.048 / 5)
    if recipe_text.get("precision") or "auto" in str(recipe_text.get("defaults")):
        assert config["precision"]["name"] in ("bf16", "fp32")  # auto resolved for the CPU
    spec = load_spec(result.run_dir)  # model.pt loads into the model the config describes
    state = torch.load(result.run_dir / "model.pt", weights_only=True)
    build_model(spec.model, build_datasets(spec.data).info).load_state_dict(state, strict=True)


def test_recipe_rerun_reproduces(cli, smoke) -> None:
    """`runner rerun RUN_DIR` of a recipe's run (mlp_digits', above) trains the same losses
    and weights bit for bit (the sweep tests show that another seed gives other losses, so
    the comparison can fail)."""
    first = smoke("mlp_digits")
    losses = [m["train/loss"] for m in first.metrics()]
    again = cli("rerun", str(first.run_dir), name="again")
    assert again.returncode == 0, again.output
    assert [m["train/loss"] for m in again.metrics()] == losses
    a = torch.load(first.run_dir / "model.pt", weights_only=True)
    b = torch.load(again.run_dir / "model.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert (again.run_dir / "config.yaml").read_text() == (
        first.run_dir / "config.yaml"
    ).read_text()


def test_user_recipe_directory(tmp_path: Path) -> None:
    import subprocess

    from tests.helpers.cli import child_env, runner_command

    (tmp_path / "mine" / "recipe").mkdir(parents=True)
    (tmp_path / "mine" / "recipe" / "tiny.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: resnet18\nglobal_batch_size: 32\n"
    )
    env = dict(child_env(), RUNNER_CONFIG_DIR=str(tmp_path / "mine"))

    def runner(*args: str) -> str:
        proc = subprocess.run(
            runner_command(*args), capture_output=True, text=True, env=env, cwd=tmp_path
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    listed = next(line for line in runner("--help").splitlines() if line.startswith("recipe:"))
    assert "tiny" in listed and "resnet50" in listed
    config = yaml.safe_load(runner("--cfg", "job", "+recipe=tiny", "global_batch_size=16"))
    assert config["model"]["_target_"].endswith(".resnet18") and config["global_batch_size"] == 16


def test_rerun_keeps_the_runs_settings_unless_a_group_switches(tmp_path: Path) -> None:
    """`runner rerun RUN parallelism=zero3` takes zero3's settings, not the run's zero2 keys;
    the run's own option named again keeps the run's settings."""
    from runner.cli.rerun import rerun_config
    from tests.helpers.config import compose_config

    config = compose_config(["parallelism=zero2", "parallelism.reduce_bucket_size=1000"])
    config["sync_strategy"] = {"name": "single_auto_sync"}  # as a ddp run's config.yaml has it
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    conf = REPO / "conf"
    switched = yaml.safe_load(rerun_config(tmp_path, conf, {"parallelism": "zero3"}))
    assert "parallelism" not in switched and {"parallelism": "???"} in switched["defaults"]
    assert switched["sync_strategy"] == {"name": "auto"}  # ddp's resolved choice would be refused
    same = yaml.safe_load(rerun_config(tmp_path, conf, {"parallelism": "zero2"}))
    assert same["parallelism"]["reduce_bucket_size"] == 1000
    assert {"parallelism": "zero2"} in same["defaults"]
