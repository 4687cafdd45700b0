"""`python -m tests.helpers.cache_builder ROOT CACHE_DIR DELAY [BATCH_BYTES [FILE_SIZE_LIMIT]]`:
builds a token cache in a process of its own, as a run's launcher would, and prints what
it found as JSON. A race waits for a file named `go` in CACHE_DIR first."""

from __future__ import annotations

import json
import logging
import resource
import signal
import sys
import time
from pathlib import Path

from runner.data import token_build, token_cache
from runner.data.tokenizing import load_tokenizer
from tests.helpers.slow_tokenizer import SlowBytes


def main(root: str, cache_dir: str, delay: str, batch: str = "", limit: str = "") -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if batch:
        token_build.BATCH_BYTES = int(batch)  # write as it goes, a piece at a time
    if limit:  # the disk fills up: writes past `limit` bytes fail (EFBIG), as ENOSPC would
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), int(limit)))
    go = Path(cache_dir) / "go"
    print("ready", flush=True)
    while not go.exists():
        time.sleep(0.01)
    cache = token_cache.open_cache(
        root, "*.txt", load_tokenizer(SlowBytes(float(delay))), "text", cache_dir
    )
    print(json.dumps({"path": str(cache.path), "built_at": cache.meta["built"]["at"]}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
