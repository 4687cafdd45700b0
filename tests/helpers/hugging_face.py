"""A tiny GPT-2 from transformers' own classes (built from its config: no download), and
the overrides that train it on a small text corpus."""

from __future__ import annotations

from pathlib import Path

GPT2 = {"vocab_size": 256, "n_positions": 32, "n_embd": 32, "n_layer": 2, "n_head": 2}


def text_corpus(root: Path) -> Path:
    folder = root / "corpus"
    folder.mkdir()
    (folder / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 200)
    return folder


def gpt2_args(corpus: Path) -> list[str]:
    args = ["model=custom", "model._target_=transformers.GPT2LMHeadModel"]
    args += ["+model.config._target_=transformers.GPT2Config"]
    args += [f"+model.config.{k}={v}" for k, v in GPT2.items()]
    args += ["data=text", f"data.root={corpus}", "data.block_size=32", "data.min_length=8"]
    return args + ["loss=causal_lm", "metrics=language_model", "global_batch_size=8"]
