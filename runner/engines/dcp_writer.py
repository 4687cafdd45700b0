"""DCP's file-system writer, whose files are digested as they are written: a note beside each
(runner.rundir.checkpoints.note_digest) that the checkpoint's manifest takes, so a sealed
DCP checkpoint's shards are never read back for it. async_save pickles the writer into its
background process: its classes live at this module's top level."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

from runner.rundir.checkpoints import DigestingWriter, note_digest


class DigestingFileSystem(FileSystem):
    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            written = DigestingWriter(stream)
            yield written
        note_digest(Path(path), written.digest())


class DigestingFileSystemWriter(FileSystemWriter):
    def __init__(self, path: str | os.PathLike, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = DigestingFileSystem()
