"""The tokenizing script a user would write by hand: the baseline `runner prepare` is
measured against (nanoGPT's prepare.py, with a Hugging Face tokenizer instead of tiktoken).

    python benchmarks/plain_tokenize.py CORPUS_DIR TOKENIZER_JSON OUT_FILE

Reads the .txt files in name order, encodes them in batches with `encode_batch_fast`
(every core), joins documents with the end-of-text token and writes one flat uint16 file.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

BATCH_BYTES = 64 << 20


def main(corpus: str, tokenizer_path: str, out: str) -> None:
    tok = Tokenizer.from_file(tokenizer_path)
    eos = tok.token_to_id("<|endoftext|>")
    files = sorted(Path(corpus).glob("*.txt"))
    with open(out, "wb") as f:
        batch: list[str] = []
        for i, path in enumerate(files):
            batch.append(path.read_text())
            if sum(map(len, batch)) >= BATCH_BYTES or i == len(files) - 1:
                for encoding in tok.encode_batch_fast(batch, add_special_tokens=False):
                    np.array([*encoding.ids, eos], dtype=np.uint16).tofile(f)
                batch = []


if __name__ == "__main__":
    main(*sys.argv[1:])
