"""`runner eval SOURCE [KEY=VALUE ...]`: evaluate weights on the validation data, no training.

SOURCE is a run directory (its model.safetensors or model.pt; without them, its latest
checkpoint), a checkpoint of any parallelism (`checkpoints/step_N`), a model.pt or a
safetensors file, or a local Hugging Face model directory. Where SOURCE belongs to a run,
the run's config.yaml is the configuration (as `runner rerun` reads it) and the overrides
change it: `nproc=4`, `eval_batches=10`, `data.root=...`. Elsewhere the overrides compose
runner's usual config (`model=... data=...`).

It becomes an ordinary launch with `init_from.path=SOURCE` and `eval_only=true`: validated
the same way before any rank starts, in a run directory of its own, where rank 0 writes
eval.json. No optimizer state is read. A run's micro-batch is kept at any nproc: the
global batch is scaled with the world size unless it is given.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from runner.cli.rerun import rerun_argv

USAGE = "usage: runner eval SOURCE [KEY=VALUE ...]  (a run directory, checkpoint or weights)"


def _run_config(directory: Path) -> bool:
    """A runner run's resolved config (not a Hugging Face model's config.yaml-less dir)."""
    path = directory / "config.yaml"
    if not path.is_file():
        return False
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return False
    return isinstance(config, dict) and {"model", "data", "parallelism"} <= set(config)


def eval_argv(argv: list[str], conf_dir: Path) -> list[str]:
    """`runner eval SOURCE [KEY=VALUE ...]` as the arguments of an ordinary launch."""
    if not argv or argv[0].startswith("-") or "=" in argv[0]:
        sys.exit(USAGE)
    source, overrides = Path(argv[0]).expanduser().resolve(), argv[1:]
    if not source.exists():
        print(f"runner eval: {argv[0]}: no such file or directory", file=sys.stderr)
        sys.exit(2)
    fixed = [f"init_from.path={source}", "eval_only=true"]
    run = next((c for c in (source, source.parent, source.parent.parent) if _run_config(c)), None)
    if run is None:
        return [*overrides, *fixed]
    return rerun_argv([str(run), *batch_overrides(run, overrides), *overrides, *fixed], conf_dir)


def batch_overrides(run: Path, overrides: list[str]) -> list[str]:
    """The run's micro-batch at the world size asked for: global_batch_size scaled, unless
    given, with grad_accum=1 (nothing accumulates in an evaluation)."""
    given = {o.partition("=")[0].lstrip("+") for o in overrides}
    if "global_batch_size" in given:
        return ["grad_accum=1"] if "grad_accum" not in given else []
    config = yaml.safe_load((run / "config.yaml").read_text())
    nproc, nodes = _int(overrides, "nproc", config), _int(overrides, "nodes", config)
    accum = config.get("grad_accum") if isinstance(config.get("grad_accum"), int) else 1
    world = config.get("nproc", 1) * config.get("nodes", 1)
    if not (nproc and nodes and isinstance(world, int) and world > 0):
        return ["grad_accum=1"]
    micro = max(1, config["global_batch_size"] // (world * accum))
    return [f"global_batch_size={micro * nproc * nodes}", "grad_accum=1"]


def _int(overrides: list[str], key: str, config: dict) -> int | None:
    for override in reversed(overrides):
        name, _, value = override.partition("=")
        if name.lstrip("+") == key:
            return int(value) if value.isdigit() else None
    value = config.get(key, 1)
    return value if isinstance(value, int) else None
