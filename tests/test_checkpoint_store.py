"""Checkpoints become visible atomically; damaged ones are never picked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.rundir.checkpoints import (
    MANIFEST,
    CheckpointStore,
    damage,
    digests_of,
    file_digest,
    is_valid,
    newest_intact,
    pick_from,
    step_of,
)


def save(store: CheckpointStore, step: int, payload: bytes = b"x" * 100) -> Path:
    partial = store.begin(step)
    (partial / "state.pt").write_bytes(payload)
    (partial / "rank1").mkdir()
    (partial / "rank1" / "optim.pt").write_bytes(payload[:10])
    return store.commit(step, digests={"state.pt": file_digest(partial / "state.pt")})


def test_commit_moves_latest_and_keeps_the_newest(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "checkpoints", keep=2)
    for step in (2, 4, 6):
        save(store, step)
    assert [p.name for p in store.finished()] == ["step_00000004", "step_00000006"]
    assert store.latest() == tmp_path / "checkpoints" / "step_00000006"
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000006"
    assert step_of(store.latest()) == 6


def test_half_written_checkpoint_is_never_latest(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    save(store, 2)
    partial = store.begin(4)  # a crash while writing step 4
    (partial / "state.pt").write_bytes(b"partial")
    assert store.latest().name == "step_00000002"
    store.scratch_dir(2).mkdir()
    store.discard_unfinished()  # once no rank runs: what was half written goes, nothing else
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000002"]
    assert is_valid(store.latest())


def test_truncated_file_falls_back_to_the_previous_checkpoint(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    save(store, 2)
    newest = save(store, 4)
    with open(newest / "state.pt", "r+b") as f:
        f.truncate(50)
    assert not is_valid(newest)
    assert store.latest().name == "step_00000002"


def test_directory_without_manifest_is_ignored(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    save(store, 2)
    copied = tmp_path / "step_00000008"  # e.g. a copy interrupted before the manifest
    copied.mkdir()
    (copied / "state.pt").write_bytes(b"x" * 100)
    assert store.latest().name == "step_00000002"


def test_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    save(store, 2, b"a" * 10)
    save(store, 2, b"b" * 20)
    assert (store.latest() / "state.pt").read_bytes() == b"b" * 20


def test_empty_store_and_bad_keep(tmp_path: Path) -> None:
    assert CheckpointStore(tmp_path / "none", keep=1).latest() is None
    with pytest.raises(ValueError, match="checkpoint.keep=0"):
        CheckpointStore(tmp_path, keep=0)


def test_failed_atomic_write_keeps_the_old_file_and_no_temporary(tmp_path, monkeypatch) -> None:
    """A write that fails partway (here fsync reports ENOSPC, as on a full disk) leaves the
    previous summary.json / model.pt whole and no temporary file behind."""
    import errno
    import os

    from runner.rundir.files import write_atomic

    target = tmp_path / "summary.json"
    write_atomic(target, '{"status": "completed"}')

    def full_disk(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_atomic(target, '{"status": "failed", "half": "')
    assert target.read_text() == '{"status": "completed"}'
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def _flip(path: Path, at: int = 3) -> None:
    """Bytes changed in place: the same size (a bad disk, a stray write)."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_every_file_is_sealed_with_its_digest(tmp_path: Path) -> None:
    """The digest taken as the write ended is kept; a file it lacks (written since) is
    digested at the seal; both verify."""
    store = CheckpointStore(tmp_path, keep=2)
    checkpoint = save(store, 2)
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    assert sorted(manifest["digests"]) == ["rank1/optim.pt", "state.pt"]
    assert manifest["digests"]["state.pt"].startswith("xxh3_128:")
    read_back = digests_of(checkpoint)
    assert manifest["digests"] == {k: v for k, v in read_back.items() if k != MANIFEST}
    assert damage(checkpoint) is None


@pytest.mark.parametrize(
    ("harm", "expected"),
    [
        (lambda c: _flip(c / "state.pt"), "state.pt does not hold the bytes written"),
        (lambda c: _flip(c / "rank1" / "optim.pt"), "rank1/optim.pt does not hold the bytes"),
        (lambda c: (c / "state.pt").write_bytes(b"x" * 7), "state.pt has 7 bytes where 100"),
        (lambda c: (c / "state.pt").unlink(), "state.pt is missing"),
        (lambda c: (c / MANIFEST).unlink(), "MANIFEST.json is missing"),
        (lambda c: (c / MANIFEST).write_text("{not json"), "MANIFEST.json is unreadable"),
        (lambda c: _flip(c / MANIFEST, 1), "MANIFEST.json is unreadable"),
    ],
)
def test_a_damaged_checkpoint_is_named_and_the_one_before_used(tmp_path, harm, expected) -> None:
    store = CheckpointStore(tmp_path, keep=3)
    save(store, 2)
    newest = save(store, 4)
    harm(newest)
    assert damage(newest).startswith(expected), damage(newest)
    pick = newest_intact(tmp_path)
    assert pick.path == tmp_path / "step_00000002"
    assert pick.skipped_lines() == [
        f"checkpoint {newest} is damaged, skipped: {damage(newest)}; resuming from step_00000002"
    ]
    harm(pick.path)
    none = newest_intact(tmp_path)
    assert none.path is None and [p.name for p, _ in none.skipped] == [
        "step_00000004",
        "step_00000002",
    ]


def test_resume_path_is_a_checkpoint_or_a_runs_newest_intact(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "run" / "checkpoints", keep=3)
    older, newest = save(store, 2), save(store, 4)
    assert pick_from(tmp_path / "run").path == newest
    _flip(newest / "state.pt")
    assert pick_from(tmp_path / "run").path == older
    named = pick_from(newest)  # a checkpoint named itself is used only if intact
    assert named.path is None and named.skipped[0][0] == newest
    assert pick_from(tmp_path / "nothing").path is None


def test_a_checkpoint_sealed_by_size_alone_still_counts(tmp_path: Path) -> None:
    """An older runner's manifest (sizes only), or checkpoint.digest=false."""
    store = CheckpointStore(tmp_path, keep=2)
    partial = store.begin(2)
    (partial / "state.pt").write_bytes(b"y" * 50)
    checkpoint = store.commit(2)
    assert "digests" not in json.loads((checkpoint / MANIFEST).read_text())
    assert damage(checkpoint) is None and newest_intact(tmp_path).path == checkpoint


def test_a_file_is_digested_as_it_is_written(tmp_path: Path) -> None:
    """torch.save through the writer: the noted digest is the file's, no second read; the
    notes go into the manifest and are gone from the sealed checkpoint."""
    import torch

    from runner.rundir.checkpoints import DigestingWriter, note_digest, take_noted_digests

    store = CheckpointStore(tmp_path, keep=2)
    partial = store.begin(2)
    (partial / "dcp").mkdir()
    for path in (partial / "state.pt", partial / "dcp" / "__0_0.distcp"):
        with open(path, "wb") as f:
            written = DigestingWriter(f)
            torch.save({"w": torch.arange(1000.0)}, written)
        note_digest(path, written.digest())
        assert written.digest() == file_digest(path)
    checkpoint = store.commit(2, digests={})
    assert not list(checkpoint.rglob(".digests")) and take_noted_digests(checkpoint) == {}
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    assert manifest["digests"] == {k: v for k, v in digests_of(checkpoint).items() if k != MANIFEST}
    with open(tmp_path / "moved.bin", "wb") as f:  # written out of order: no digest kept
        written = DigestingWriter(f)
        written.write(b"abcd")
        written.seek(0)
        written.write(b"x")
    assert written.digest() is None


def test_a_ranks_failed_write_leaves_its_peers_writing_and_the_parent_sweeps_it(
    tmp_path: Path,
) -> None:
    """One rank's write fails (ENOSPC) while another still writes into the same partial
    directory: the failing rank's error names the path, the OS error and the resume point,
    and the directory stays under its peer (its write goes on, so its own error never
    passes for the run's cause); once every rank is gone, discard_unfinished removes it."""
    import errno

    from runner.train.checkpoints.checkpointing import CheckpointWriteError, failing_write

    store = CheckpointStore(tmp_path / "checkpoints", keep=2)
    save(store, 4)
    partial = store.begin(6)
    peer = (partial / "model.pt").open("wb")  # rank 0, mid-write
    peer.write(b"x" * 10)
    filled = partial / "rank1.pt"
    with pytest.raises(CheckpointWriteError) as failed, failing_write(store, 6):
        raise OSError(errno.ENOSPC, "No space left on device", str(filled))
    message = str(failed.value)
    assert "checkpoint of step 6 could not be written: No space left on device" in message
    assert str(filled) in message and "the resume point stays" in message
    assert message.split("stays ")[1].startswith(str(store.root / "step_00000004"))
    peer.write(b"y" * 10)
    peer.close()
    (partial / "meta.json").write_text("{}")  # the peer's next file
    assert (partial / "model.pt").stat().st_size == 20
    assert store.latest() == store.root / "step_00000004"
    store.discard_unfinished()
    assert sorted(p.name for p in store.root.iterdir()) == ["latest", "step_00000004"]
