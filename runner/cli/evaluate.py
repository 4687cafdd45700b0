"""`runner eval SOURCE [KEY=VALUE ...]`: evaluate weights on the validation data, no training.

SOURCE is a run directory (its model.safetensors or model.pt; without them, its latest
checkpoint), a checkpoint of any parallelism (`checkpoints/step_N`), a model.pt or a
safetensors file, or a local Hugging Face model directory. Where SOURCE belongs to a run,
the run's config.yaml is the configuration (as `runner rerun` reads it) and the overrides
change it: `nproc=4`, `eval_batches=10`, `data.root=...`. Elsewhere the overrides compose
runner's usual config (`model=... data=...`).

It becomes an ordinary launch with `init_from.path=SOURCE` and `eval_only=true`: validated
the same way before any rank starts, in a run directory of its own, where rank 0 writes
eval.json. No optimizer state is read. At any nproc, it scores the samples the run's
evaluations scored, each rank a batch as large as theirs (`run_evaluations`), so its
figures are the run's logged ones.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


NO_CHAOS = ("chaos.kill_rank=null", "chaos.at_step=null")


def eval_argv(argv: list[str], conf_dir: Path) -> list[str]:
    """`runner eval SOURCE [KEY=VALUE ...]` as the arguments of an ordinary launch."""
    if not argv or argv[0].startswith("-") or "=" in argv[0]:
        print(USAGE, file=sys.stderr)
        sys.exit(2)
    source, overrides = Path(argv[0]).expanduser().resolve(), argv[1:]
    if not source.exists():
        print(f"runner eval: {argv[0]}: no such file or directory", file=sys.stderr)
        sys.exit(2)
    fixed = [f"init_from.path={source}", "eval_only=true"]
    run = next((c for c in (source, source.parent, source.parent.parent) if _run_config(c)), None)
    if run is None:
        return [*overrides, *fixed]
    config = yaml.safe_load((run / "config.yaml").read_text())
    sized = run_evaluations(config, overrides)
    for line in sized.notes:
        print(f"runner eval: {line}", file=sys.stderr)
    # a drill's fault injection is the training's: at another nproc its rank may not exist
    argv = [str(run), *sized.before, *overrides, *sized.after, *fixed, *NO_CHAOS]
    return rerun_argv(argv, conf_dir)


@dataclass
class Sizing:
    """Overrides put before the user's (theirs win) and after them, and what to tell."""

    before: list[str] = field(default_factory=list)
    after: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


MESH = ("pipeline", "context", "tensor")  # the mesh's model dimensions: ranks that share data


def run_evaluations(config: dict[str, Any], overrides: list[str]) -> Sizing:
    """The run's evaluations at the world size asked for: the very samples they scored
    (eval_batches counts the run's global batches: eval_samples), in the very batches
    (eval_ranks: the run's data ranks), each rank's batch as large as theirs, and the run's
    mesh where it fits the new world (a dimension that does not is dropped, and said so:
    the weights are the same whatever splits them)."""
    given = dict(o.lstrip("+").partition("=")[::2] for o in overrides if "=" in o)
    sized = Sizing()
    if config.get("profile"):  # the run's traces were of its training steps, on its ranks
        sized.before += ["profile.steps=[]", "profile.ranks=main", "profile.memory=false"]
    batch = config.get("global_batch_size")
    if "eval_samples" not in given:
        batches = given.get("eval_batches", config.get("eval_batches"))
        if isinstance(batch, int) and str(batches).isdigit():
            sized.after += [f"eval_samples={int(batches) * batch}", "eval_batches=null"]
    if "global_batch_size" in given:
        sized.before += [] if "grad_accum" in given else ["grad_accum=1"]
        return sized
    world, new_world = _world(config, {}), _world(config, given)
    parallelism = config.get("parallelism") or {}
    degrees = {k: parallelism.get(k, 1) for k in MESH}
    if not (world and new_world and isinstance(batch, int)):
        sized.before.append("grad_accum=1")
        return sized
    switched = "parallelism" in given and given["parallelism"] != parallelism.get("name")
    new = {k: _as_int(given.get(f"parallelism.{k}"), 1 if switched else degrees[k]) for k in MESH}
    if new_world % math.prod(new.values()):
        dropped = [k for k in MESH if new[k] > 1 and f"parallelism.{k}" not in given]
        for k in dropped:
            new[k] = 1
            sized.before.append(f"parallelism.{k}=1")
        if dropped:
            shown = " x ".join(f"{k}={degrees[k]}" for k in dropped)
            sized.notes.append(
                f"the run's {shown} does not fit {new_world} rank(s): evaluated without it "
                f"({' '.join(f'parallelism.{k}=1' for k in dropped)}; the same weights)"
            )
    _fit_experts(parallelism, given, new_world // math.prod(new.values()), switched, sized)
    replicate = parallelism.get("replicate")
    kept = isinstance(replicate, int) and not switched and "parallelism.replicate" not in given
    if kept and (new_world // math.prod(new.values())) % replicate:
        sized.before.append("parallelism.replicate=null")  # one copy per node
    run_ranks = max(1, world // math.prod(degrees.values()))
    data_ranks = max(1, new_world // math.prod(new.values()))
    sized.before += [f"global_batch_size={batch // run_ranks * data_ranks}", "grad_accum=1"]
    if "eval_ranks" not in given:  # its batches, sample for sample: runner.data.sampler
        sized.after.append(f"eval_ranks={config.get('eval_ranks') or run_ranks}")
    return sized


def _fit_experts(
    parallelism: dict[str, Any], given: dict[str, str], data: int, switched: bool, sized: Sizing
) -> None:
    """The run's expert groups are cut from its data ranks: where the new `data` ranks
    cannot hold them, evaluated without them (every rank holding every expert)."""
    expert = parallelism.get("expert", 1)
    if switched or "parallelism.expert" in given or not isinstance(expert, int) or expert < 2:
        return
    if data % expert:
        sized.before.append("parallelism.expert=1")
        sized.notes.append(
            f"the run's expert={expert} does not fit {data} data rank(s): evaluated without "
            "it (parallelism.expert=1; the same weights)"
        )


def _as_int(value: str | None, default: Any) -> int:
    if value is not None and value.isdigit():
        return int(value)
    return default if isinstance(default, int) else 1


def _world(config: dict[str, Any], given: dict[str, str]) -> int | None:
    """nproc x nodes, as given on the command line or the run's; None where not a number."""
    sizes = []
    for key in ("nproc", "nodes"):
        value = given.get(key, config.get(key, 1))
        value = int(value) if isinstance(value, str) and value.isdigit() else value
        if not isinstance(value, int) or value < 1:
            return None
        sizes.append(value)
    return sizes[0] * sizes[1]
