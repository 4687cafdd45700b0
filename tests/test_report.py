"""runner-report's choice of columns: the config values that really differ between runs."""

from __future__ import annotations

from pathlib import Path

import yaml

from runner.cli.report import differing_keys, run_config


def write_run(root: Path, name: str, config: dict, resolved: bool = True) -> Path:
    run = root / name
    target = run / "config.yaml" if resolved else run / ".hydra" / "config.yaml"
    target.parent.mkdir(parents=True)
    target.write_text(yaml.safe_dump(config))
    return run


def test_differing_keys(tmp_path: Path) -> None:
    ddp = {"parallelism": {"name": "ddp", "bucket_cap_mb": 25.0}, "seed": 0, "nproc": 2}
    zero = {"parallelism": {"name": "zero2", "overlap_comm": False}, "seed": 0, "nproc": 2}
    other_seed = {**ddp, "seed": 1, "device": "cpu"}
    rejected = {"parallelism": {"name": "ddp"}, "seed": 0, "nproc": 2, "device": "auto"}
    runs = [
        write_run(tmp_path, "a", ddp),
        write_run(tmp_path, "b", zero),
        write_run(tmp_path, "c", {**other_seed, "device": "cpu"}),
        write_run(tmp_path, "d", rejected, resolved=False),  # a sweep job that never started
    ]
    configs = [run_config(run) for run in runs]
    # option-specific keys of a switched group are left out; `auto` of a rejected job is not
    # a difference; a key only one resolved run has is.
    assert differing_keys(runs, configs) == ["device", "parallelism.name", "seed"]
