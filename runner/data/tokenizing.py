"""The tokenizers a token cache is built with, behind one small interface.

`data.tokenizer` is null (UTF-8 bytes: 256 ids, no file), a path (a Hugging Face
`tokenizers` file, tokenizer.json, or a local directory holding one: what
`save_pretrained` writes), or a component with `encode(text) -> ids` (a transformers
tokenizer, or the user's own). A Hugging Face tokenizer encodes a batch of documents on
every core at once (its Rust `encode_batch`); a component without one encodes them in turn.

Documents are joined by the tokenizer's end-of-text token where it has one
(`<|endoftext|>`, `</s>`, ...), else by the tokens of a blank line: what byte-level data
always used.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

END_OF_TEXT = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "[EOS]")
BLANK_LINE = "\n\n"


def _text(value: str | bytes) -> str:
    return value if isinstance(value, str) else value.decode("utf-8", errors="replace")


class ByteTokenizer:
    """UTF-8 bytes as tokens: no vocabulary file, 256 ids; documents joined by a blank line."""

    vocab_size = 256
    identity = "utf-8 bytes"
    description = "UTF-8 bytes"

    def __init__(self) -> None:
        self.separator = np.frombuffer(BLANK_LINE.encode(), np.uint8).astype(np.int64)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_many(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        return [
            np.frombuffer(t if isinstance(t, bytes) else t.encode("utf-8"), np.uint8) for t in texts
        ]


class HuggingFaceTokenizer:
    """A `tokenizers.Tokenizer`: batches encoded in parallel (its threads, all cores)."""

    def __init__(self, tokenizer: Any, description: str, eos_id: int | None = None):
        self.tokenizer = tokenizer
        self.description = description
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        eos_id = eos_id if eos_id is not None else self._end_of_text()
        if eos_id is not None:
            self.separator = np.array([eos_id], np.int64)
        else:
            ids = tokenizer.encode(BLANK_LINE, add_special_tokens=False).ids
            self.separator = np.array(ids, np.int64)
        serialized = tokenizer.to_str().encode()
        self.identity = "tokenizers " + hashlib.sha256(serialized).hexdigest()

    def _end_of_text(self) -> int | None:
        special = {
            t.content: i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special
        }
        return next((special[name] for name in END_OF_TEXT if name in special), None)

    def encode_many(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        batch = [_text(t) for t in texts]
        encodings = self.tokenizer.encode_batch_fast(batch, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]


class EncoderTokenizer:
    """A component with `encode(text)` and `vocab_size` (or `len()`): one document at a time."""

    def __init__(self, component: Any):
        self.component = component
        self.description = type(component).__qualname__
        size = len(component) if hasattr(component, "__len__") else component.vocab_size
        self.vocab_size = int(size)
        eos = getattr(component, "eos_token_id", None)
        ids = [eos] if isinstance(eos, int) else list(component.encode(BLANK_LINE))
        self.separator = np.array(ids, np.int64)
        self.identity = f"{type(component).__module__}.{self.description} " + _digest(component)

    def encode_many(self, texts: Sequence[str | bytes]) -> list[np.ndarray]:
        return [np.asarray(self.component.encode(_text(t)), dtype=np.int64) for t in texts]


def _digest(component: Any) -> str:
    """What a component's vocabulary is, as far as pickling it tells (else its size alone:
    a changed vocabulary of the same size then goes unnoticed, and the docs say so)."""
    try:
        return hashlib.sha256(pickle.dumps(component)).hexdigest()
    except Exception:
        return f"vocab_size={getattr(component, 'vocab_size', '?')}"


Tokenizer = ByteTokenizer | HuggingFaceTokenizer | EncoderTokenizer


def tokenizer_file(value: str | Path) -> Path:
    """The tokenizer.json that `data.tokenizer=PATH` names (PATH or PATH/tokenizer.json)."""
    path = Path(value).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
        if not path.is_file():
            raise ValueError(
                f"data.tokenizer={str(value)!r}: the directory has no tokenizer.json (write one "
                "with a Hugging Face tokenizer's save_pretrained(DIR), or name the file)"
            )
    elif not path.is_file():
        raise ValueError(f"data.tokenizer={str(value)!r}: no such file or directory")
    return path


def load_tokenizer(value: Any) -> Tokenizer:
    """The tokenizer `data.tokenizer` names (see the module's docstring)."""
    if value is None:
        return ByteTokenizer()
    if isinstance(value, (str, Path)):
        from tokenizers import Tokenizer as HFTokenizer

        path = tokenizer_file(value)
        try:
            loaded = HFTokenizer.from_file(str(path))
        except Exception as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ValueError(
                f"data.tokenizer={str(value)!r}: not a Hugging Face tokenizer file ({first})"
            ) from None
        return HuggingFaceTokenizer(loaded, str(path))
    backend = getattr(value, "backend_tokenizer", None)  # a transformers fast tokenizer
    if backend is not None:
        eos = getattr(value, "eos_token_id", None)
        return HuggingFaceTokenizer(backend, type(value).__qualname__, eos)
    if isinstance(value, (ByteTokenizer, HuggingFaceTokenizer, EncoderTokenizer)):
        return value
    if not callable(getattr(value, "encode", None)):
        raise ValueError(
            f"data.tokenizer: {type(value).__name__} has no encode(text) method; give a "
            "tokenizer.json path, a directory holding one, or a component with encode()"
        )
    return EncoderTokenizer(value)
