"""The run spec's `plan` keys: how parallelism=auto chooses a layout (runner.layouts), and
memory sizes as a user writes them (`300MB`, `2GB`); re-exported by runner.spec.schema."""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from runner.spec.bounds import bound as _bound
from runner.spec.convert import SpecError

UNITS = {"": 1, "B": 1, "KB": 2**10, "MB": 2**20, "GB": 2**30, "TB": 2**40}
SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int | None:
    """Bytes of a size such as `300MB`, `2GB`, `1.5GiB` or `4096B` (binary units: a MB is
    2**20 bytes, as memory/peak_mb counts them); None when it is not one, a bare number
    among them (`300`: bytes, or the megabytes the user meant? `bare_number` says so)."""
    match = SIZE.match(str(text))
    if not match or match.group(3) is None:
        return None
    number, prefix, _ = match.groups()
    value = float(number) * UNITS[prefix.upper() + "B" if prefix else ""]
    return int(value) if value > 0 else None


def megabytes(value: float) -> str:
    """A size as the plan's messages say it: `41 MB`, `2.5 MB`, `512 KB`."""
    if abs(value) < 2**20:
        return f"{value / 2**10:,.0f} KB"
    return f"{value / 2**20:,.{1 if abs(value) < 10 * 2**20 else 0}f} MB"


# plan.check_margin: null by the device, wider than the largest errors measured there (on
# a CPU a rank's resident memory: benchmarks/results/plan_families.md and plan_moe.md, where
# gpt_moe_text's expert and tensor splits measured up to 55% over their predictions, what
# DTensor and gloo's all-to-all hold besides the tensors not modelled; on a GPU CUDA's most
# allocated, held within 15% by tests/gpu/test_plan.py)
CHECK_MARGIN = {"cpu": 0.6, "cuda": 0.2}
# What a rank's peak may still grow after a trial's few steps, which a layout measured in a
# trial keeps room for within the budget: on a CPU its resident memory grew up to 15% from
# 4 to 100 steps (benchmarks/results/plan_families.md, its growth table: gpt_text's, where
# its library pages are not counted); on a GPU CUDA's most allocated holds the step's
# tensors, the same every step
LATER_GROWTH = {"cpu": 0.15, "cuda": 0.05}
# ... and on a CPU at least this much: a rank's resident memory also jumps by some tens of MB
# at a later phase (a tiny Llama's final evaluation of its whole validation set added 20 to
# 30 MB to one rank's peak or the other's, from run to run, where a trial's one batch had
# not), which a share of a small model's peak does not cover
LATER_GROWTH_FLOOR = {"cpu": 32 * 2**20, "cuda": 0}
MORE = "more ranks (nproc), or a smaller microbatch (global_batch_size)"


def shortfall(what: str, budget: int, budget_from: str, least: str, need: int, more: str) -> str:
    """No layout within the budget: `what` (fits, trialled ran within, ...), the least one
    and how much it needs (`need`), and what would help (`more`)."""
    needs = megabytes(need)
    if needs == megabytes(budget):  # 100 MB against 100 MB: the digits that tell them apart
        needs = f"{need / 2**20:,.2f} MB"
    return (
        f"parallelism=auto: no layout {what} {megabytes(budget)} per rank ({budget_from}); "
        f"the least, {least}, needs {needs} ({megabytes(need - budget)} more); give "
        f"more memory (plan.memory_per_rank), {more}"
    )


class NoneFits(SpecError):
    """No valid layout fits the budget: the problem, and the plan that weighed them."""

    def __init__(self, problems: list[str], plan: dict[str, Any]):
        super().__init__(problems)
        self.plan = plan


def bare_number(text: str | int) -> bool:
    """A size given without its unit (`300`)."""
    return not isinstance(text, bool) and re.fullmatch(r"\s*\d+(\.\d+)?\s*", str(text)) is not None


@dataclass(frozen=True)
class PlanSpec:
    """parallelism=auto: the fastest predicted layout that fits `memory_fraction` of a GPU's
    memory, or `memory_per_rank` (on a CPU by default: RAM over the node's ranks); with
    `trials` > 0 the best `trials` layouts each run `trial_steps` steps and the fastest
    measured one trains; with none, a pick predicted within `check_margin` of the budget
    runs `trial_steps` steps first, and one measured over it gives way to the next."""

    memory_per_rank: str | int | None = None
    memory_fraction: float = _bound(0.9, gt=0.0, max=1.0)
    trials: int = _bound(0, min=0)
    trial_steps: int = _bound(6, min=2)
    # a pick predicted within this share of the budget is run for trial_steps steps first,
    # measured, and not kept over it (0: trust the prediction; null: CHECK_MARGIN's, by
    # the device)
    check_margin: float | None = _bound(None, min=0.0, max=0.9)


# The layout keys a user may fix for parallelism=auto: its config key -> the candidate's field
FIXABLE = {
    "grad_accum": "grad_accum",
    "activation_checkpointing": "checkpointing",
    "parallelism.tensor": "tensor",
    "parallelism.pipeline": "pipeline",
    "parallelism.context": "context",
    "parallelism.expert": "expert",
    "parallelism.replicate": "replicate",
}


def group_option(conf_dir: Path, group: str, option: str) -> dict[str, Any]:
    """A config group's option as its file holds it (conf/parallelism/fsdp.yaml): a copy,
    the file read once."""
    return copy.deepcopy(_read_option(conf_dir / group / f"{option}.yaml"))


@functools.cache
def _read_option(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}
