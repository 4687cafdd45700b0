"""Bad input fails in the parent, before any rank starts: short message, no traceback, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.spec import SpecError, resolve_spec
from tests.test_compose import compose_config


def problems(*overrides: str, cuda_devices: int = 0) -> list[str]:
    with pytest.raises(SpecError) as info:
        resolve_spec(compose_config(list(overrides)), cuda_devices=cuda_devices)
    return info.value.problems


# (overrides, the text the message must contain: key=value and what is valid)
CASES = [
    (
        ["global_batch_size=63"],
        "global_batch_size=63: not divisible by world_size x grad_accum = 2 x 1 = 2",
    ),
    (["grad_accum=3"], "pick a multiple of 6"),
    (["nproc=0"], "nproc=0: must be >= 1"),
    (["nproc=many"], "nproc='many': expected an integer or one of auto"),
    (["nodes=2", "node_rank=2", "master_port=29500"], "node_rank=2: must be in 0..1 for nodes=2"),
    (["node_rank=-1"], "node_rank=-1: must be >= 0"),
    (["data=image_folder"], "data.root=null: data=image_folder reads local files"),
    (
        ["data=image_folder", "data.root=/does/not/exist"],
        "data.root='/does/not/exist': directory does not exist",
    ),
    (["data=cifar10", "data.root=/tmp"], "data=cifar10 needs the python-pickle files"),
    (
        ["device=cuda"],
        "device='cuda': no CUDA device is visible on this machine; valid here: auto, cpu",
    ),
    (["device=tpu"], "device='tpu': expected one of auto, cpu, cuda"),
    (["precision=fp16", "device=cpu"], "precision=fp16 needs CUDA"),
    (["master_port=70000"], "master_port=70000: must be <= 65535"),
    (["master_port=0"], "master_port=0: must be >= 1"),
    (["nodes=2"], "master_port=null: nodes=2 needs a fixed port"),
    (["max_steps=0"], "max_steps=0: must be >= 1"),
    (["max_epochs=-3"], "max_epochs=-3: must be >= 1"),
    (["max_steps=null", "max_epochs=null"], "set at least one of them"),
    (["log_interval=0"], "log_interval=0: must be >= 1"),
    (["grad_accum=0"], "grad_accum=0: must be >= 1"),
    (["grad_accum=abc"], "grad_accum='abc': expected an integer"),
    (["optimizer.lr=-1"], "optimizer.lr=-1: must be > 0"),
    (["optimizer.betas=[0.9]"], "optimizer.betas=[0.9]: expected a list of 2 values"),
    (["parallelism.bucket_cap_mb=big"], "parallelism.bucket_cap_mb='big': expected a number"),
    (
        ["parallelism.static_graph=maybe"],
        "parallelism.static_graph='maybe': expected true or false",
    ),
    (["+model.depth=3"], "model.depth: unknown key; valid keys here: hidden_sizes, name"),
    (["chaos.kill_rank=5", "chaos.at_step=2"], "chaos.kill_rank=5: must be a rank in 0..1"),
    (["chaos.kill_rank=1"], "set both or neither"),
    (["resume=/no/such/checkpoint"], "resume='/no/such/checkpoint': no such file or directory"),
]


@pytest.mark.parametrize(("overrides", "expected"), CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_value_is_named(overrides: list[str], expected: str) -> None:
    found = problems(*overrides)
    assert any(expected in p for p in found), found


def test_every_problem_is_reported_at_once() -> None:
    found = problems("grad_accum=0", "nproc=0", "device=tpu")
    assert len(found) == 3, found


def test_cuda_checks_use_the_visible_device_count() -> None:
    assert "only 2 CUDA device(s) visible" in problems("device=cuda", "nproc=4", cuda_devices=2)[0]
    spec = resolve_spec(compose_config(["device=auto", "nproc=auto"]), cuda_devices=4)
    assert (spec.device, spec.nproc) == ("cuda", 4)


CLI_CASES = [
    (["global_batch_size=63"], "global_batch_size=63"),
    (["nproc=0"], "nproc=0: must be >= 1"),
    (["device=cuda"], "device='cuda'"),
    (["precision=fp16"], "precision=fp16 needs CUDA"),
    (["data=image_folder", "data.root=missing_dir"], "directory does not exist"),
    (["master_port=99999"], "master_port=99999: must be <= 65535"),
    (["max_steps=-1"], "max_steps=-1: must be >= 1"),
]


@pytest.mark.parametrize(
    ("overrides", "expected"), CLI_CASES, ids=[" ".join(c[0]) for c in CLI_CASES]
)
def test_cli_rejects_before_any_rank_starts(
    cli, tmp_path: Path, overrides: list[str], expected: str
) -> None:
    result = cli(*overrides)
    assert result.returncode == 2, result.output
    assert expected in result.stderr
    assert "invalid configuration" in result.stderr
    assert "Traceback" not in result.output
    assert not result.run_dir.exists(), "a rejected run must leave no run directory"


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["parallelism=fsdp"], "Could not find 'parallelism/fsdp'"),
        (["nprocs=2"], "Could not override 'nprocs'"),
    ],
)
def test_cli_unknown_option_or_key(cli, overrides: list[str], expected: str) -> None:
    result = cli(*overrides)
    assert result.returncode != 0
    assert expected in result.stderr
    assert "Traceback" not in result.output
    assert not result.run_dir.exists()
