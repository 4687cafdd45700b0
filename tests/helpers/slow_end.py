"""A user's callback that takes its time after the run ended (summary.json written): the
moment a SIGTERM must change nothing."""

from __future__ import annotations

import time

from runner.callbacks import Callback, Run


class SlowEnd(Callback):
    def on_fit_end(self, run: Run, summary: dict) -> None:
        if run.is_main:
            (run.run_dir / "ended").write_text("summary written\n")
            time.sleep(60)
