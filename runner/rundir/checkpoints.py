"""Where checkpoints live on disk, and how one becomes "latest" without ever being half there.

    checkpoints/
      step_00000040/           a finished checkpoint: its files + MANIFEST.json
      step_00000060/
      .partial-step_00000080/  being written (a crash leaves it; it is never read)
      latest                   the name of the newest finished checkpoint

A checkpoint is written into `.partial-step_N/`, then MANIFEST.json records the
size of every file, the directory is renamed to `step_N/`, and only then does
`latest` move (write a temporary file, rename it over the old one). Reading
trusts nothing: a checkpoint counts only if its manifest is there and every
file has the recorded size, so a truncated file or a half-copied directory is
skipped and the previous good checkpoint is used.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from runner.rundir.files import write_atomic

MANIFEST = "MANIFEST.json"
LATEST = "latest"
_NAME = re.compile(r"^step_(\d{8})$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


class CheckpointStore:
    def __init__(self, root: Path, keep: int):
        if keep < 1:
            raise ValueError(f"checkpoint.keep={keep}: must be >= 1")
        self.root = Path(root)
        self.keep = keep

    def partial_dir(self, step: int) -> Path:
        """The directory to write step's files into (same path on every rank)."""
        return self.root / f".partial-{checkpoint_name(step)}"

    def scratch_dir(self, step: int) -> Path:
        """A directory for converting step's checkpoint when resuming it (never a checkpoint)."""
        return self.root / f".convert-{checkpoint_name(step)}"

    def begin(self, step: int) -> Path:
        """Start a checkpoint: a fresh, empty partial directory (one process calls this)."""
        partial = self.partial_dir(step)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        return partial

    def commit(self, step: int) -> Path:
        """Seal the partial directory of `step`, make it latest, prune old ones."""
        partial = self.partial_dir(step)
        files = {
            str(p.relative_to(partial)): p.stat().st_size
            for p in sorted(partial.rglob("*"))
            if p.is_file()
        }
        write_atomic(partial / MANIFEST, json.dumps({"step": step, "files": files}, indent=1))
        final = self.root / checkpoint_name(step)
        if final.exists():  # the same step saved again after a restart: replace it
            shutil.rmtree(final)
        os.replace(partial, final)
        write_atomic(self.root / LATEST, final.name + "\n")
        self._prune()
        return final

    def discard_unfinished(self) -> None:
        """Remove what no finished checkpoint needs: partial directories (a write that failed,
        or ranks killed mid-write) and resharding scratch. Call it only while no rank runs."""
        if self.root.is_dir():
            for path in self.root.glob(".*-step_*"):
                shutil.rmtree(path, ignore_errors=True)

    def finished(self) -> list[Path]:
        """Valid checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if _NAME.match(p.name) and is_valid(p)]
        return sorted(found, key=lambda p: p.name)

    def latest(self) -> Path | None:
        """The newest valid checkpoint on disk.

        Validity, not the `latest` file, decides: the file is for people and tools, and a
        crash between the rename and the pointer update must not lose the newer checkpoint.
        """
        valid = self.finished()
        return valid[-1] if valid else None

    def _prune(self) -> None:
        for old in self.finished()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)


def is_valid(checkpoint: Path) -> bool:
    """True when the manifest is readable and every file it lists has its recorded size."""
    try:
        manifest = json.loads((checkpoint / MANIFEST).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    for name, size in files.items():
        try:
            if (checkpoint / name).stat().st_size != size:
                return False
        except OSError:
            return False
    return bool(files)


def step_of(checkpoint: Path) -> int:
    match = _NAME.match(checkpoint.name)
    if not match:
        raise ValueError(f"{checkpoint} is not a checkpoint directory (step_NNNNNNNN)")
    return int(match.group(1))


def resolve_checkpoint_path(path: Path) -> Path | None:
    """A checkpoint directory itself, or the latest valid checkpoint of a run directory."""
    if is_valid(path):
        return path
    for root in (path / "checkpoints", path):
        latest = CheckpointStore(root, keep=1).latest()
        if latest is not None:
            return latest
    return None
