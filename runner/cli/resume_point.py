"""The checkpoint a run will resume from, verified in the parent before anything is written.

resume=auto (and a requeued SLURM job) goes on from the run's newest intact checkpoint, and
resume=PATH from PATH's: each file is read back against the digest it was sealed with
(runner.rundir.checkpoints). A damaged checkpoint is named on the terminal with what is wrong
and the one the run falls back to; where checkpoints exist and none is intact, the run is
refused (exit 2, naming each) rather than trained from step 0. Rank 0 checks again as it
loads (a restart after a failure picks its checkpoint there).
"""

from __future__ import annotations

import logging
from pathlib import Path

from runner.rundir.checkpoints import CheckpointStore, Pick, newest_intact, pick_from, step_of
from runner.rundir.files import read_jsonl
from runner.spec import RunSpec
from runner.spec.resume_check import check_resume

log = logging.getLogger("runner")


def resume_problems(spec: RunSpec, run_dir: Path) -> list[str]:
    """Why this run cannot resume as configured ([]: it can, or it starts afresh); says on
    the terminal which damaged checkpoints it skips."""
    if spec.resume is None:
        return []
    own = spec.resume == "auto"
    if own:
        _say_damaged_records(run_dir / "metrics.jsonl")
    pick = newest_intact(run_dir / "checkpoints") if own else pick_from(Path(spec.resume))
    if pick.path is None:  # the refusal names each damaged one
        return [_none_intact(spec.resume, pick)] if pick.skipped else []
    for line in pick.skipped_lines():
        log.warning("runner: %s", line)
    cheap = CheckpointStore(run_dir / "checkpoints", keep=1).latest() if own else None
    # a fallback: the settings it holds are checked too
    problems = check_resume(spec, pick.path) if own and pick.path != cheap else []
    if not problems:
        log.info(
            "runner: resume=%s: going on from the checkpoint of step %s (%s)",
            spec.resume, _step(pick.path), pick.path,
        )  # fmt: skip
    return problems


def _step(checkpoint: Path) -> str:
    """The step a checkpoint holds, by its name ('?' for a directory named otherwise)."""
    try:
        return str(step_of(checkpoint))
    except ValueError:
        return "?"


def _none_intact(resume: str, pick: Pick) -> str:
    damaged = "; ".join(f"{p} ({why})" for p, why in pick.skipped)
    return (
        f"resume={resume}: no intact checkpoint to resume from, and training from step 0 would "
        f"hide that: {damaged}. Restore them, resume=PATH another checkpoint, or move them "
        "aside to start over"
    )


def _say_damaged_records(metrics: Path) -> None:
    """metrics.jsonl's unreadable lines, named before rank 0 drops them as it goes on."""
    damaged: list[int] = []
    read_jsonl(metrics, damaged)
    if damaged:
        lines = ", ".join(map(str, damaged[:5])) + (", ..." if len(damaged) > 5 else "")
        log.warning(
            "runner: %s: %d unreadable line(s) (line %s) are dropped; the records around them "
            "are kept",
            metrics,
            len(damaged),
            lines,
        )
