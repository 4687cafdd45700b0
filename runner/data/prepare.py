"""`python -m runner.data.prepare SPEC_DIR [--rebuild] [--verify]`: what `runner prepare`
runs once the parent has checked the config (SPEC_DIR holds its config.yaml).

Builds the data's cache (runner.data.datasets.prepare_data), or finds it built, and says
where it is, what it holds and how fast it was built. `--rebuild` builds it again;
`--verify` reads every token against the checksum taken when they were written.
Exit 0 when the cache is ready, 2 on bad input, 1 when verification fails.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from runner.data.datasets import prepare_data, preparer
from runner.data.token_cache import CacheDamaged, TokenCache
from runner.errors import first_line
from runner.processes import add_code_dirs
from runner.spec import load_spec


def describe(cache: TokenCache, since: float) -> str:
    meta = cache.meta
    text_bytes = sum(size for _, size, _ in meta["files"])
    built = meta["built"]
    lines = [
        f"token cache: {cache.path}",
        f"  {cache.tokens:,} tokens ({cache.dtype.name}, vocabulary {cache.vocab_size:,}) in "
        f"{cache.documents:,} documents from {len(meta['files']):,} files "
        f"({text_bytes / 1e6:,.1f} MB of text; tokenizer: {meta['tokenizer']})",
    ]
    if built["at"] >= since:
        rate = text_bytes / 1e6 / max(built["seconds"], 1e-9)
        lines.append(f"  built in {built['seconds']:.1f} s: {rate:,.1f} MB/s of text")
    else:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(built["at"]))
        lines.append(f"  already built ({when}); --rebuild builds it again")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    spec = load_spec(Path(argv[0]))
    add_code_dirs(spec.code_dir)
    if preparer(spec.data) is None:
        print(
            f"runner prepare: data={spec.data.name} keeps no cache; there is nothing to prepare "
            "(a run builds it as it starts)"
        )
        return 0
    since = time.time()
    try:
        cache = prepare_data(spec.data, rebuild="--rebuild" in argv)
    except (ValueError, OSError) as exc:
        print(f"runner prepare: {first_line(exc)}", file=sys.stderr)
        return 2
    if "--verify" in argv and isinstance(cache, TokenCache):
        try:
            cache.verify()
        except CacheDamaged as exc:
            print(f"runner prepare: damaged: {exc}; --rebuild builds it again", file=sys.stderr)
            return 1
        print("verified: every token matches its checksum")
    print(describe(cache, since) if isinstance(cache, TokenCache) else f"prepared: {cache}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
