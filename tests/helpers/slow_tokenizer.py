"""A tokenizer component that takes its time, so that token-cache builds can be raced,
killed and run out of disk while they run (tests/test_token_cache.py)."""

from __future__ import annotations

import time


class SlowBytes:
    """UTF-8 bytes, after `delay` seconds per text."""

    vocab_size = 256

    def __init__(self, delay: float = 0.05):
        self.delay = delay

    def encode(self, text: str) -> list[int]:
        time.sleep(self.delay)
        return list(text.encode("utf-8"))
