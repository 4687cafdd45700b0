"""End to end from the CLI: real ranks over gloo, every artifact of the run directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from runner.models import build_model
from runner.spec import load_spec
from tests.helpers.cli import FAST, HANG, REPO, RESTARTABLE, child_env, runner_command

DIGITS_INFO = {"input_shape": (1, 8, 8), "num_classes": 10}  # what data=digits reports

pytestmark = pytest.mark.slow
METRIC_KEYS = {"step", "samples", "train/loss", "lr", "throughput/samples_per_sec"}


def test_default_experiment_fills_the_run_directory(default_run) -> None:
    result = default_run
    run = result.run_dir

    config = yaml.safe_load((run / "config.yaml").read_text())
    assert "${" not in (run / "config.yaml").read_text()
    assert (
        config["nproc"] == 2
        and config["device"] == "cpu"
        and config["model"]["_target_"] == "runner.models.builders.mlp"
    )
    assert config["sync_strategy"]["name"] == "single_auto_sync"
    assert (run / ".hydra" / "config.yaml").is_file() and (
        run / ".hydra" / "overrides.yaml"
    ).is_file()

    env = json.loads((run / "env.json").read_text())
    assert env["packages"]["torch"] == torch.__version__.split("+")[0]
    assert {"python", "packages", "git", "hosts"} <= set(env)

    for rank in (0, 1):
        log = (run / "logs" / f"rank{rank}.log").read_text()
        assert f"rank {rank} attempt 0" in log

    metrics = result.metrics()
    assert all(set(m) >= METRIC_KEYS for m in metrics)
    steps = [m["step"] for m in metrics]
    assert steps == sorted(steps) and steps[0] == 10
    evals = [m for m in metrics if "val/accuracy" in m]
    assert len(evals) == 12  # once per epoch
    assert metrics[-1]["samples"] == 12 * 1438  # every sample of every epoch, nothing padded

    summary = result.summary()
    assert summary["status"] == "completed"
    assert summary["world_size"] == 2
    assert summary["steps"] == metrics[-1]["step"] == 276
    assert summary["wall_time_s"] > 0
    assert summary["final"] == metrics[-1]
    from tests.helpers.trackers import scalars

    curves = scalars(run / "tensorboard")  # `tensorboard --logdir runs/` sees every step
    assert [step for step, _ in curves["train/loss"]] == steps
    assert [step for step, _ in curves["val/accuracy"]] == [m["step"] for m in evals]
    assert summary["final"]["val/accuracy"] >= 0.90
    sizes = summary["optimizer_state_bytes"]
    params = 64 * 128 + 128 + 128 * 64 + 64 + 64 * 10 + 10
    assert sizes == [2 * 4 * params, 2 * 4 * params]  # AdamW: exp_avg + exp_avg_sq in fp32

    state = torch.load(run / "model.pt", weights_only=True)
    assert not any(k.startswith("module.") for k in state)
    spec = load_spec(run)
    model = build_model(spec.model, DIGITS_INFO)
    model.load_state_dict(state, strict=True)
    from safetensors.torch import load_file  # the same weights, without pickle

    safe = load_file(str(run / "model.safetensors"))
    assert safe.keys() == state.keys() and all(torch.equal(safe[k], state[k]) for k in state)

    assert "val/accuracy 0.9" in result.stderr
    assert str(run.name) in result.stderr
    assert "Traceback" not in result.output


def test_runner_report_of_the_default_run_as_typed(default_run, tmp_path: Path) -> None:
    """`runner-report RUN`: the run's row (status, steps, final metrics) and its loss curves
    written into the run directory (a copy here: the run is shared)."""
    import shutil

    run = shutil.copytree(default_run.run_dir, tmp_path / "default")
    report = Path(sys.executable).parent / "runner-report"  # the console script
    done = subprocess.run(
        [str(report), str(run)], cwd=tmp_path, capture_output=True, text=True, env=child_env(),
        timeout=HANG,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    final = default_run.summary()["final"]
    assert "completed" in done.stdout and "276" in done.stdout
    assert f"{final['val/accuracy']:.4f}"[:4] in done.stdout
    assert (run / "report.png").stat().st_size > 0 and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        ("--help", "model: custom, gpt, gpt_moe, mlp, resnet18, resnet50"),
        ("--cfg", "global_batch_size: 64"),
        ("--info", "Config search path"),
    ],
)
def test_hydra_flags(flag: str, expected: str, tmp_path) -> None:
    args = [flag, "job"] if flag == "--cfg" else [flag]
    proc = subprocess.run(
        runner_command(*args), capture_output=True, text=True, cwd=tmp_path, env=child_env()
    )
    assert proc.returncode == 0, proc.stderr
    assert expected in proc.stdout
    assert not (tmp_path / "runs").exists()


def test_parent_process_does_not_import_torch(tmp_path: Path) -> None:
    """Everything the parent does before the agent starts: compose, resolve (with a resume
    checkpoint to check, same model and a different one), write the run files."""
    from tests.helpers.checkpoints import save_checkpoint

    checkpoint = save_checkpoint(tmp_path / "old", ["model=mlp", "data=digits", "device=cpu"])
    code = f"""
import sys
sys.argv = ['runner', '--cfg', 'job']
import runner.cli.entry
try:
    runner.cli.entry.main()
except SystemExit:
    pass
from runner.rundir.files import environment_info
from runner.spec import SpecError, resolve_spec, save_spec
from tests.helpers.config import compose_config

# The first run's path as a user takes it: each agent a new interpreter (tests/helpers/warm.py).
COLD_START = True
base = ['model=mlp', 'data=digits', 'device=cpu', 'resume={checkpoint}']
save_spec(resolve_spec(compose_config(base), run_dir='{tmp_path / "new"}'), '{tmp_path}')
environment_info()
try:
    resolve_spec(compose_config([*base, 'model.hidden_sizes=[8]']))
except SpecError as err:
    print(err.problems)
heavy = [m for m in ('torch', 'torchvision', 'deepspeed', 'sklearn') if m in sys.modules]
print('HEAVY', heavy)
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=child_env()
    )
    assert "first mismatching parameter '1.weight'" in proc.stdout, proc.stdout + proc.stderr
    assert "HEAVY []" in proc.stdout, proc.stdout + proc.stderr


def test_two_runs_at_once_do_not_clash(tmp_path) -> None:
    """Started together (the same second, often the same millisecond), in one directory:
    each gets its own run directory under the cwd's runs/ and its own rendezvous port (one
    rank each: the agent's store is what could clash, and 2 cores run 2 ranks best)."""
    procs = [
        subprocess.Popen(
            runner_command(*FAST, "max_steps=20", "nproc=1"),
            cwd=tmp_path,
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    for proc in procs:
        _, stderr = proc.communicate(timeout=HANG)
        assert proc.returncode == 0, stderr
    runs = sorted((tmp_path / "runs").iterdir())
    assert len(runs) == 2
    for run in runs:
        summary = json.loads((run / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["steps"] == 20


def test_image_folder_bf16_single_rank(cli, tmp_path) -> None:
    from tests.helpers.datasets import make_image_folder

    root = make_image_folder(tmp_path / "images", classes=2, per_class=8, size=12)
    result = cli(
        "data=image_folder",
        f"data.root={root}",
        "data.image_size=8",
        "data.num_workers=1",
        "model=mlp",
        "precision=bf16",
        "nproc=1",
        "global_batch_size=4",
        "max_steps=4",
        "progress_bar=false",
    )
    assert result.returncode == 0, result.output
    summary = result.summary()
    assert summary["world_size"] == 1 and summary["steps"] == 4
    assert summary["final"]["val/accuracy"] >= 0.0


def test_zero_runs_hold_half_the_optimizer_state(cli, zero2_offload_run) -> None:
    """zero1 and zero2 (this one offloading to CPU) from the CLI: every artifact, about half
    of AdamW's full optimizer state per rank, and the same weights (the equivalence tests
    hold zero1 to plain PyTorch)."""
    results = {
        "zero1": cli(*RESTARTABLE, "parallelism=zero1", name="zero1"),
        "zero2": zero2_offload_run,
    }
    weights = {}
    for name, result in results.items():
        assert result.returncode == 0, result.output
        for artifact in ("config.yaml", "env.json", "metrics.jsonl", "summary.json", "model.pt"):
            assert (result.run_dir / artifact).is_file(), artifact
        assert (result.run_dir / "logs" / "rank1.log").is_file()
        summary = result.summary()
        assert summary["status"] == "completed" and summary["parallelism"] == name
        model = build_model(load_spec(result.run_dir).model, DIGITS_INFO)
        full_state = 2 * 4 * sum(p.numel() for p in model.parameters())  # AdamW: 2 fp32 moments
        per_rank = summary["optimizer_state_bytes"]
        assert len(per_rank) == 2
        assert all(0.45 * full_state <= b <= 0.55 * full_state for b in per_rank), per_rank
        weights[name] = torch.load(result.run_dir / "model.pt", weights_only=True)
        model.load_state_dict(weights[name])
    zero1, zero2 = weights["zero1"], weights["zero2"]
    assert all(torch.allclose(zero2[k], zero1[k], rtol=1e-5, atol=1e-7) for k in zero1)


def test_eval_batches_evaluates_the_first_samples_of_the_validation_set(cli) -> None:
    """eval_batches=1 with 3 ranks and a global batch of 48: every evaluation is the loss of
    the validation set's first 48 samples, as the final weights give it here."""
    from runner.data.digits import digits

    result = cli(*FAST, "nproc=3", "global_batch_size=48", "max_epochs=null", "max_steps=4",
                 "eval_batches=1")  # fmt: skip
    assert result.returncode == 0, result.output
    model = build_model(load_spec(result.run_dir).model, DIGITS_INFO)
    model.load_state_dict(torch.load(result.run_dir / "model.pt", weights_only=True))
    images, labels = digits().val.batch(list(range(48)))
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(images), labels).item()
    assert result.summary()["final"]["val/loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("preset", [None, "/elsewhere/extensions"])
def test_torch_extensions_are_built_into_this_environment(preset: str | None) -> None:
    """Two checkouts on one machine used to share ~/.cache/torch_extensions and rebuild
    DeepSpeed's op for each other; the runner command keeps it in its own venv (what
    the user set wins), and every process it starts inherits it."""
    env = child_env()
    env.pop("TORCH_EXTENSIONS_DIR", None)
    if preset:
        env["TORCH_EXTENSIONS_DIR"] = preset
    code = (
        "import os, sys; sys.argv = ['runner', '--cfg', 'job']\n"
        "import runner.cli.entry\n"
        "try:\n    runner.cli.entry.main()\nexcept SystemExit:\n    pass\n"
        "print('DIR', os.environ.get('TORCH_EXTENSIONS_DIR'))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env
    )
    expected = preset or str(Path(sys.prefix) / "torch_extensions")
    assert f"DIR {expected}" in proc.stdout, proc.stdout + proc.stderr
