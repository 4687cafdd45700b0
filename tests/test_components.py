"""A user's own code trains through `_target_`: the examples/ project from its own folder, a
model named on the command line alone, a torchvision model, a Hugging Face causal LM built
from its config class (no download), and torchmetrics metrics."""

from __future__ import annotations

import enum
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import pytest

from runner.components import instantiate, problems
from tests.helpers.cli import HANG, REPO, CliResult, child_env, runner_command

pytestmark = pytest.mark.slow

EXAMPLE = REPO / "examples" / "waves"


def test_example_project_trains_from_its_own_folder(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        runner_command(
            "--config-dir",
            "conf",
            "+recipe=waves",
            "progress_bar=false",
            f"hydra.run.dir={run_dir}",
        ),
        cwd=EXAMPLE,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    result = CliResult(proc.returncode, proc.stdout, proc.stderr, run_dir)
    assert result.returncode == 0, result.output
    metrics = result.metrics()
    assert metrics[-1]["train/loss"] < 0.3 * metrics[0]["train/loss"]
    assert result.summary()["final"]["val/amplitude_mae"] < 0.2
    assert not (EXAMPLE / "runs").exists()


def run_in(cwd: Path, *overrides: str, timeout: float = 300) -> CliResult:
    run_dir = cwd / "run"
    proc = subprocess.run(
        runner_command(*overrides, "progress_bar=false", f"hydra.run.dir={run_dir}"),
        cwd=cwd,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr, run_dir)


USER_MODEL = '''
import sys
from pathlib import Path

import torch
from torch import nn

with open(Path(__file__).with_name("imported_by.txt"), "a") as log:  # which process imports us
    log.write(sys.modules["__main__"].__spec__.name + "\\n")


class Net(nn.Module):
    """Keyword inputs and a dict output holding logits, as Hugging Face models have."""

    def __init__(self, input_shape, num_classes, width=8):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU())
        self.head = nn.Linear(width, num_classes)

    def forward(self, pixels):
        return {"logits": self.head(self.body(pixels))}


def dict_batches(val_fraction=0.2):
    from runner.data.digits import digits

    data = digits(val_fraction=val_fraction)

    def collate(samples):
        images, labels = zip(*samples)
        return {"pixels": torch.stack(images), "labels": torch.stack(labels)}

    return {"train": data.train, "val": data.val, "collate_fn": collate, **data.info}
'''


def test_command_line_alone_names_user_code_in_the_launch_directory_or_a_code_dir(
    tmp_path: Path,
) -> None:
    (tmp_path / "mynets.py").write_text(USER_MODEL)
    here = run_in(
        tmp_path,
        "model=custom",
        "model._target_=mynets.Net",
        "+model.width=16",
        "data=custom",
        "data._target_=mynets.dict_batches",
        "optimizer.lr=0.01",
        "max_steps=40",
    )
    assert here.returncode == 0, here.output
    final = here.summary()["final"]
    assert final["val/accuracy"] > 0.5 and "val/loss" in final
    importers = set((tmp_path / "imported_by.txt").read_text().split())
    assert importers == {"runner.launch.agent", "runner.train.worker"}  # never the parent

    elsewhere = tmp_path / "launch"
    elsewhere.mkdir()
    (tmp_path / "lib").mkdir()
    (tmp_path / "mynets.py").rename(tmp_path / "lib" / "mynets.py")
    (tmp_path / "imported_by.txt").unlink()
    subprocess.run(["git", "init", "-q", str(tmp_path / "lib")], check=True)
    there = run_in(
        elsewhere,
        f"code_dir=[{tmp_path / 'lib'}]",
        "model=custom",
        "model._target_=mynets.Net",
        "max_steps=2",
    )
    assert there.returncode == 0, there.output
    env = __import__("json").loads((there.run_dir / "env.json").read_text())
    assert str(tmp_path / "lib") in env["git"]["code_dir"]


def test_torchvision_model_and_torchmetrics_metrics(tmp_path: Path) -> None:
    """num_classes reaches torchmetrics' metrics from the data; their values are over every
    rank's samples, as runner's own accuracy is."""
    result = run_in(
        tmp_path,
        "model=custom",
        "model._target_=torchvision.models.resnet18",
        "+model.num_classes=10",
        "data=synthetic",
        "data.num_train=64",
        "data.num_val=30",  # 15 per rank, batches of 8: uneven
        "global_batch_size=16",
        "max_steps=3",
        "+metrics.f1._target_=torchmetrics.classification.MulticlassF1Score",
        "+metrics.micro._target_=torchmetrics.classification.MulticlassAccuracy",
        "+metrics.micro.average=micro",
    )
    assert result.returncode == 0, result.output
    final = result.summary()["final"]
    assert final["val/micro"] == pytest.approx(final["val/accuracy"], abs=1e-6)
    assert 0.0 <= final["val/f1"] <= 1.0


def test_hugging_face_causal_lm_trains_through_target(tmp_path: Path) -> None:
    """GPT-2 built from its config class (no download): keyword inputs, an output object
    holding logits, runner's token-weighted causal LM loss on ragged, padded batches. Its
    ranks are forks of the server that imported transformers' GPT-2 for them (its import
    loads scipy's OpenBLAS, whose pool would have left the server unfit to fork)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    config = "+model.config"
    result = run_in(
        tmp_path,
        "model=custom",
        "model._target_=transformers.GPT2LMHeadModel",
        f"{config}._target_=transformers.GPT2Config",
        f"{config}.vocab_size=256",
        f"{config}.n_positions=32",
        f"{config}.n_embd=32",
        f"{config}.n_layer=2",
        f"{config}.n_head=2",
        "data=text",
        f"data.root={corpus}",
        "data.block_size=32",
        "data.min_length=8",
        "loss=causal_lm",
        "metrics=language_model",
        "optimizer.lr=3e-3",
        "global_batch_size=8",
        "max_steps=16",
        "log_interval=4",
    )
    assert result.returncode == 0, result.output
    losses = [m["train/loss"] for m in result.metrics()]
    assert losses[-1] < 0.8 * losses[0], losses
    assert result.summary()["final"]["val/perplexity"] < 256
    assert "spawning the ranks instead" not in result.output
    assert "forked by the fork server" in result.rank_log(1)


def test_problems_bind_arguments_without_calling_anything() -> None:
    def build(width: int, depth: int = 2, *, num_classes: int) -> None:
        raise AssertionError("never called")

    node = {"_target_": f"{__name__}.FAKE", "width": 3}
    globals()["FAKE"] = build
    assert problems("model", node, {"num_classes": 10}) == []
    assert problems("model", {**node, "wdth": 3}, {"num_classes": 10}) == [
        f"model.wdth: unexpected argument of {__name__}.FAKE; did you mean width?"
    ]
    assert problems("model", node, {}) == [
        f"model.num_classes: missing; {__name__}.FAKE needs it (set +model.num_classes=...)"
    ]
    assert problems("model", {**node, "n_layer": 4}, {"num_classes": 10}) == [
        f"model.n_layer: unexpected argument of {__name__}.FAKE; it takes width, depth, "
        "num_classes (~model.n_layer drops it)"
    ]
    assert problems("model", {**node, "_partial_": True, "width": 1}, {}) == []
    nested = {"_target_": "collections.OrderedDict", "inner": {"_target_": "math.nope"}}
    assert problems("x", nested) == ["x.inner._target_=math.nope: math has no attribute 'nope'"]


def test_instantiate_passes_what_the_target_takes_of_the_provided_values() -> None:
    made = instantiate({"_target_": "collections.Counter", "a": 1}, {"b": 2, "num_classes": 3})
    assert made == {"a": 1}  # Counter(**kwargs) names none of them: nothing injected
    linear = instantiate({"_target_": "torch.nn.Linear"}, {"in_features": 4, "out_features": 2})
    assert tuple(linear.weight.shape) == (2, 4)


class Mode(enum.Enum):
    FAST = "fast"
    SLOW = "slow"


def annotated(
    width: int,
    rate: float = 0.1,
    name: str = "net",
    bias: bool = True,
    kind: Literal["conv", "dense"] = "dense",
    mode: Mode = Mode.FAST,
    sizes: Sequence[int] = (8,),
    depth: int | None = None,
    sloppy: int = None,  # type: ignore[assignment]  # None is what its author passes
    free=None,
) -> None:
    raise AssertionError("never called")


def test_values_are_checked_against_their_annotations_all_at_once() -> None:
    node = {"_target_": f"{__name__}.annotated"}
    good = {"width": 3, "rate": 1, "name": 7, "bias": False, "kind": "conv", "mode": "slow",
            "sizes": [1, 2], "depth": None, "sloppy": None, "free": {"a": 1}}  # fmt: skip
    assert problems("model", {**node, **good}) == []
    bad = {"width": "abc", "rate": "fast", "bias": "yes", "kind": "rnn", "mode": "FASTER",
           "sizes": [1, "two"], "depth": 2.5}  # fmt: skip
    where = f"(as {__name__}.annotated annotates it)"
    assert problems("model", {**node, **bad}) == [
        f"model.width='abc': expected int {where}",
        f"model.rate='fast': expected float {where}",
        f"model.bias='yes': expected bool {where}",
        f"model.kind='rnn': expected one of 'conv', 'dense' {where}",
        f"model.mode='FASTER': expected one of 'fast', 'slow' {where}",
        f"model.sizes=[1, 'two']: expected a list of int {where}",
        f"model.depth=2.5: expected int or null {where}",
    ]


USER_OPTIMIZER = '''
import torch


class SignSGD(torch.optim.Optimizer):
    """Steps by the sign of the gradient: a user's optimizer class, given runner's groups."""

    def __init__(self, params, lr: float = 0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


def halving(optimizer, total_steps: int, every: int = 2):
    """A user's schedule function: halve the lr every `every` steps."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** (step // every))
'''


def test_user_optimizer_and_schedule_functions_train(tmp_path: Path) -> None:
    """A user's optimizer class and schedule function through DeepSpeed's client-optimizer
    path (ddp builds them the same way: the torch ones below); runner's warmup runs before
    the schedule, the lr multiplier scales the head's group from its own start."""
    (tmp_path / "myopt.py").write_text(USER_OPTIMIZER)
    result = run_in(
        tmp_path,
        "parallelism=zero2",
        "optimizer=custom",
        "optimizer._target_=myopt.SignSGD",
        "+optimizer.lr=0.004",
        "optimizer.lr_multipliers={5:2.0}",  # the head of the mlp (a Sequential)
        "scheduler=custom",
        "scheduler._target_=myopt.halving",
        "+scheduler.every=2",
        "scheduler.warmup_steps=2",
        "max_steps=6",
        "log_interval=1",
    )
    assert result.returncode == 0, result.output
    lrs = [m["lr"] for m in result.metrics() if "lr" in m]
    assert lrs == pytest.approx([0.002, 0.004, 0.004, 0.004, 0.002, 0.002])
    losses = [m["train/loss"] for m in result.metrics() if "train/loss" in m]
    assert losses[-1] < losses[0]


def test_torch_optimizer_and_scheduler_by_name(tmp_path: Path) -> None:
    result = run_in(
        tmp_path,
        "optimizer=custom",
        "optimizer._target_=torch.optim.Adafactor",
        "+optimizer.lr=0.01",
        "scheduler=custom",
        "scheduler._target_=torch.optim.lr_scheduler.StepLR",
        "+scheduler.step_size=2",
        "+scheduler.gamma=0.5",
        "max_steps=4",
        "log_interval=1",
    )
    assert result.returncode == 0, result.output
    lrs = [m["lr"] for m in result.metrics() if "lr" in m]
    assert lrs == pytest.approx([0.01, 0.01, 0.005, 0.005])
    config = (result.run_dir / "config.yaml").read_text()
    assert "_target_: torch.optim.Adafactor" in config
