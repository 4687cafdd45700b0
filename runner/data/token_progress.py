"""What a token-cache build shows while it runs: a progress bar on a terminal, a line every
30 s in a log (SLURM's output, a rank's log), and the totals when it ends."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

log = logging.getLogger("runner")
LOG_EVERY_S = 30.0


class BuildProgress:
    def __init__(self, total_bytes: int, where: Path):
        self.total, self.where = max(total_bytes, 1), where
        self.done = 0
        self.started = self.last_line = time.perf_counter()
        log.info("runner: tokenizing %.1f MB of text into %s", total_bytes / 1e6, where)
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=self.total, unit="B", unit_scale=True, desc="tokenizing", leave=False
            )

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def advance(self, size: int) -> None:
        self.done += size
        if self.bar is not None:
            self.bar.update(size)
        elif time.perf_counter() - self.last_line > LOG_EVERY_S:
            self.last_line = time.perf_counter()
            log.info(
                "runner: tokenizing: %.0f%% (%.1f MB/s)",
                100 * self.done / self.total,
                self.done / 1e6 / max(self.elapsed, 1e-9),
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def report(self, tokens: int, documents: int) -> None:
        seconds = max(self.elapsed, 1e-9)
        log.info(
            "runner: token cache built: %s tokens in %s documents, %.1f MB of text in %.1f s "
            "(%.1f MB/s)",
            f"{tokens:,}",
            f"{documents:,}",
            self.done / 1e6,
            seconds,
            self.done / 1e6 / seconds,
        )
