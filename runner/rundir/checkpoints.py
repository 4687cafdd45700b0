"""Where checkpoints live on disk, and how one becomes "latest" without ever being half there.

    checkpoints/
      step_00000040/           a finished checkpoint: its files + MANIFEST.json
      step_00000060/
      .partial-step_00000080/  being written (a crash leaves it; it is never read)
      latest                   the name of the newest finished checkpoint

A checkpoint is written into `.partial-step_N/`, then MANIFEST.json records the size and a
content digest (xxh3-128, taken as each large file is written: `DigestingWriter`) of every
file, the directory is renamed to `step_N/`, and only then does `latest` move (write a
temporary file, rename it over the old one). Reading trusts nothing: a checkpoint counts
only if its manifest is there and every file has the recorded size (`is_valid`, cheap), and
the checkpoint a run resumes from must also hold the recorded bytes (`verify`): a truncated
file, a half-copied directory or bytes flipped in place are each found, named, and the
previous intact checkpoint is used (`newest_intact`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

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

    def commit(self, step: int, digests: dict[str, str] | None = None) -> Path:
        """Seal the partial directory of `step`, make it latest, prune old ones. `digests`:
        the files' content digests taken as their write ended (any file it lacks, such as a
        small one written since, is digested here); None: a checkpoint sealed by size only
        (checkpoint.digest=false)."""
        partial = self.partial_dir(step)
        noted = take_noted_digests(partial)  # taken while the files were written
        names = [str(p.relative_to(partial)) for p in sorted(partial.rglob("*")) if p.is_file()]
        files = {name: (partial / name).stat().st_size for name in names}
        manifest: dict = {"step": step, "files": files}
        if digests is not None:
            known = {**noted, **digests}
            manifest["digests"] = {
                name: known.get(name) or file_digest(partial / name) for name in names
            }
        write_atomic(partial / MANIFEST, json.dumps(manifest, indent=1))
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
    return damage(checkpoint, read_contents=False) is None


def damage(checkpoint: Path, read_contents: bool = True) -> str | None:
    """What is wrong with a checkpoint, naming the file (None: intact): a missing or
    unreadable manifest, a file missing or of another size than recorded, and (when
    `read_contents`) a file whose bytes no longer match its recorded digest. A checkpoint
    sealed without digests (an older runner's, or checkpoint.digest=false) is checked by
    size alone."""
    try:
        manifest = json.loads((checkpoint / MANIFEST).read_text())
        files = manifest["files"]
        digests = manifest.get("digests") or {}
        if not isinstance(files, dict) or not isinstance(digests, dict) or not files:
            raise TypeError
    except OSError:
        return f"{MANIFEST} is missing"
    except (ValueError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    for name, size in files.items():
        try:
            actual = (checkpoint / name).stat().st_size
        except OSError:
            return f"{name} is missing"
        if actual != size:
            return f"{name} has {actual} bytes where {size} were written"
    if not read_contents:
        return None
    for name, digest in digests.items():
        try:
            if file_digest(checkpoint / name, str(digest).split(":", 1)[0]) != digest:
                return f"{name} does not hold the bytes written (its digest differs)"
        except (OSError, ValueError) as exc:
            return f"{name} cannot be read ({exc})"
    return None


@dataclass
class Pick:
    """The checkpoint a run resumes from (None: none intact) and each newer one it skipped,
    with why."""

    path: Path | None
    skipped: list[tuple[Path, str]] = field(default_factory=list)

    def skipped_lines(self) -> list[str]:
        fallback = f"resuming from {self.path.name}" if self.path else "none is left to resume"
        return [f"checkpoint {p} is damaged, skipped: {why}; {fallback}" for p, why in self.skipped]


def newest_intact(root: Path) -> Pick:
    """The newest checkpoint under `root` whose every file holds the bytes written, and the
    newer ones that did not (each checkpoint directory counts, the damaged included)."""
    if not root.is_dir():
        return Pick(None)
    found = sorted((p for p in root.iterdir() if _NAME.match(p.name)), key=lambda p: p.name)
    skipped = []
    for checkpoint in reversed(found):
        problem = damage(checkpoint)
        if problem is None:
            return Pick(checkpoint, skipped)
        skipped.append((checkpoint, problem))
    return Pick(None, skipped)


def pick_from(path: Path) -> Pick:
    """resume=PATH: a checkpoint directory itself (used only if intact), or the newest intact
    checkpoint of a run directory (or of its checkpoints/ folder)."""
    if (path / MANIFEST).exists() or _NAME.match(path.name):
        problem = damage(path)
        return Pick(path) if problem is None else Pick(None, [(path, problem)])
    for root in (path / "checkpoints", path):
        pick = newest_intact(root)
        if pick.path is not None or pick.skipped:
            return pick
    return Pick(None)


# xxh3-128 (the xxhash package) reads about 5 GB/s on one core here; sha1 (hashlib, 1.5 GB/s)
# where xxhash is not installed. A digest names its algorithm: "xxh3_128:<hex>".
def _hasher(algorithm: str):  # noqa: ANN202  (a hashlib- or xxhash-style object)
    if algorithm == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128()
    if algorithm in hashlib.algorithms_available:
        return hashlib.new(algorithm)
    raise ValueError(f"unknown digest algorithm {algorithm!r}")


def _default_algorithm() -> str:
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "sha1"
    return "xxh3_128"


CHUNK = 8 * 2**20


def file_digest(path: Path, algorithm: str | None = None) -> str:
    """`algorithm:hexdigest` of a file's bytes, read in chunks of up to 8 MB (a small file's
    buffer is its size: zeroing 8 MB costs more than reading a manifest's small files)."""
    algorithm = algorithm or _default_algorithm()
    hasher = _hasher(algorithm)
    with open(path, "rb", buffering=0) as f:
        buffer = bytearray(max(1, min(CHUNK, os.fstat(f.fileno()).st_size)))
        view = memoryview(buffer)
        while True:
            read = f.readinto(buffer)
            if not read:
                break
            hasher.update(view[:read])
    return f"{algorithm}:{hasher.hexdigest()}"


class DigestingWriter:
    """A binary file that digests what is written through it, as it is written: a large
    checkpoint file costs no second read. Writes must come in order (torch.save and DCP's
    writers do); a seek elsewhere drops the digest, and the file is read back instead."""

    def __init__(self, file: BinaryIO, algorithm: str | None = None):
        self.file = file
        self.algorithm = algorithm or _default_algorithm()
        self.hasher = _hasher(self.algorithm)
        self.in_order = True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.hasher.update(view)
        return self.file.write(view)

    def digest(self) -> str | None:
        return f"{self.algorithm}:{self.hasher.hexdigest()}" if self.in_order else None

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        here = self.file.tell()
        moved = self.file.seek(offset, whence)
        self.in_order &= moved == here
        return moved

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, close, closed, ...
        return getattr(self.file, name)


NOTES = ".digests"  # beside files a rank wrote: their digests, taken into the manifest


def note_digest(path: Path, digest: str | None) -> None:
    """Keep the digest of `path`, taken while it was written (any process, any rank), for
    the manifest; the checkpoint is sealed without the note. Renamed into place but not
    synced: a crash before the seal discards the whole partial checkpoint anyway."""
    if digest is None:
        return
    note = path.parent / NOTES / path.name
    note.parent.mkdir(exist_ok=True)
    tmp = note.with_name(f".{note.name}.tmp{os.getpid()}")
    tmp.write_text(digest)
    os.replace(tmp, note)


def take_noted_digests(directory: Path) -> dict[str, str]:
    """The digests noted below `directory`, by their files' paths there; the notes go."""
    noted = {}
    for notes in sorted(directory.rglob(NOTES)):
        for note in notes.iterdir():
            target = notes.parent / note.name
            if target.is_file() and not note.name.startswith("."):
                noted[str(target.relative_to(directory))] = note.read_text().strip()
        shutil.rmtree(notes, ignore_errors=True)
    return noted


def digests_of(directory: Path) -> dict[str, str]:
    """Every file's digest below `directory`, by its path there."""
    return {
        str(p.relative_to(directory)): file_digest(p)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


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
