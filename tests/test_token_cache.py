"""The token cache of `data=text`: keyed by content, built once under a lock by one of many
processes, never half-built or stale when served, read without a per-rank copy.

Real files, real processes racing and being killed, real Hugging Face tokenizers trained
on the tests' own text; no network.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from runner.data import corpus, token_build, token_cache
from runner.data.text import text_files
from runner.data.tokenizing import ByteTokenizer, load_tokenizer
from tests.helpers.cli import HANG, REPO, child_env, runner_command
from tests.helpers.refusals import refused

WORDS = ["alpha", "beta", "gamma", "delta", "runner", "token", "batch", "rank", "step"]


def write_corpus(root: Path, files: int = 3, words: int = 200, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    texts = []
    for i in range(files):
        lines = [" ".join(rng.choice(WORDS, 10)) for _ in range(words // 10)]
        texts.append("\n".join(lines) + "\n")
        (root / f"doc{i:03d}.txt").write_text(texts[-1])
    return texts


def stream(cache: token_cache.TokenCache) -> np.ndarray:
    return np.fromfile(cache.tokens_file, dtype=cache.dtype)


def open_bytes(root: Path, cache_dir: Path, pattern: str = "*.txt") -> token_cache.TokenCache:
    return token_cache.open_cache(root, pattern, ByteTokenizer(), "text", str(cache_dir))


def bpe_tokenizer(texts: list[str], path: Path, vocab_size: int = 300) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path))
    return path


# ------------------------------------------------------------------ content and formats


def test_documents_are_stored_in_name_order_with_separators(tmp_path: Path) -> None:
    texts = write_corpus(tmp_path / "c")
    cache = open_bytes(tmp_path / "c", tmp_path / "cache")
    expected = "\n\n".join(texts).encode()
    assert stream(cache).tobytes() == np.frombuffer(expected, np.uint8).astype(np.uint16).tobytes()
    starts = np.fromfile(cache.path / "documents.bin", dtype=np.uint64)
    assert starts.tolist() == [0, len(texts[0]) + 2, len(texts[0]) + len(texts[1]) + 4]
    assert (cache.tokens, cache.documents, cache.dtype) == (len(expected), 3, np.uint16)
    assert cache.path.parent == tmp_path / "cache" and cache.path.name.startswith("c-")


def test_the_key_follows_files_and_tokenizer(tmp_path: Path) -> None:
    root, where = tmp_path / "c", tmp_path / "cache"
    texts = write_corpus(root)
    first = open_bytes(root, where)
    again = open_bytes(root, where)
    assert again.path == first.path and again.meta["built"] == first.meta["built"]  # reused

    (root / "doc001.txt").write_text(texts[1].replace("alpha", "omega"))  # changed
    changed = open_bytes(root, where)
    assert changed.path != first.path and b"omega" in stream(changed).astype(np.uint8).tobytes()

    os.utime(root / "doc001.txt", ns=(1, 1))  # same bytes, another modification time
    assert open_bytes(root, where).path != changed.path

    (root / "doc100.txt").write_text("added\n")
    added = open_bytes(root, where)
    assert stream(added).astype(np.uint8).tobytes().endswith(b"\n\nadded\n")
    (root / "doc100.txt").unlink()
    (root / "doc000.txt").unlink()
    removed = open_bytes(root, where)
    assert removed.documents == 2 and removed.path not in {first.path, added.path}

    bpe = load_tokenizer(str(bpe_tokenizer(texts, tmp_path / "tok.json")))
    other = token_cache.open_cache(root, "*.txt", bpe, "text", str(where))
    assert other.path != removed.path and other.vocab_size == bpe.vocab_size


def test_a_hugging_face_tokenizer_file_or_directory(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    texts = write_corpus(tmp_path / "c", files=2)
    (tmp_path / "tok").mkdir()
    path = bpe_tokenizer(texts, tmp_path / "tok" / "tokenizer.json")
    tok = Tokenizer.from_file(str(path))
    eos = tok.token_to_id("<|endoftext|>")
    expected = [*tok.encode(texts[0]).ids, eos, *tok.encode(texts[1]).ids]
    for name in (str(path), str(tmp_path / "tok")):
        data = text_files(str(tmp_path / "c"), block_size=8, pattern="*.txt", tokenizer=name)
        assert data.info["vocab_size"] == tok.get_vocab_size()
        blocks = [data.train[i]["input_ids"].tolist() for i in range(len(data.train))]
        assert sum(blocks, []) == expected[: 8 * len(blocks)]


def test_large_files_are_tokenized_in_pieces_as_a_whole(tmp_path: Path, monkeypatch) -> None:
    """Pieces are cut at line starts, where byte-level BPE cuts words anyway."""
    from tokenizers import Tokenizer

    texts = write_corpus(tmp_path / "c", files=1, words=2000)
    path = bpe_tokenizer(texts, tmp_path / "tok.json")
    monkeypatch.setattr(corpus, "PIECE_BYTES", 97)
    monkeypatch.setattr(token_build, "BATCH_BYTES", 300)
    pieces = list(corpus.read_pieces(tmp_path / "c" / "doc000.txt", "text"))
    assert len(pieces) > 50 and b"".join(p.text for p in pieces).decode() == texts[0]
    cache = token_cache.open_cache(
        tmp_path / "c", "*.txt", load_tokenizer(str(path)), "text", str(tmp_path / "cache")
    )
    assert stream(cache).tolist() == Tokenizer.from_file(str(path)).encode(texts[0]).ids


def test_json_lines_and_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = ["first document", "second one", "a third"]
    (tmp_path / "j").mkdir()
    lines = [json.dumps({"text": d, "id": i}) for i, d in enumerate(docs)]
    (tmp_path / "j" / "part.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "p").mkdir()
    table = pa.table({"text": docs, "id": [0, 1, 2]})
    pq.write_table(table, tmp_path / "p" / "part.parquet", row_group_size=2)
    for folder, pattern in (("j", "*.jsonl"), ("p", "*.parquet")):
        cache = open_bytes(tmp_path / folder, tmp_path / "cache", pattern)
        assert stream(cache).astype(np.uint8).tobytes() == "\n\n".join(docs).encode()
        assert cache.documents == 3


def test_a_json_line_without_the_text_field_is_named(tmp_path: Path) -> None:
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "a.jsonl").write_text('{"text": "ok"}\n\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"a\.jsonl, line 3: no text in data\.text_field='text'"):
        open_bytes(tmp_path / "j", tmp_path / "cache", "*.jsonl")
    (tmp_path / "j" / "a.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(ValueError, match=r"a\.jsonl, line 2: not JSON"):
        open_bytes(tmp_path / "j", tmp_path / "cache", "*.jsonl")
    assert [p for p in (tmp_path / "cache").iterdir() if p.is_dir()] == []  # no cache kept


def test_token_dtype_follows_the_vocabulary(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000}
    big = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    big.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    big.save(str(tmp_path / "big.json"))
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.txt").write_text("w1 w69999 w65536 w2 " * 10)
    tokenizer = load_tokenizer(str(tmp_path / "big.json"))
    cache = token_cache.open_cache(tmp_path / "c", "*.txt", tokenizer, "text", str(tmp_path))
    assert cache.dtype == np.uint32 and stream(cache)[:4].tolist() == [1, 69999, 65536, 2]
    with pytest.raises(ValueError, match="data.token_dtype=uint16: the tokenizer has 70,001 ids"):
        token_cache.open_cache(tmp_path / "c", "*.txt", tokenizer, "text", str(tmp_path), "uint16")


def test_unpacked_blocks_never_span_documents(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    docs = ["x" * 5, "y" * 12, "z" * 3, "w" * 9]
    for i, doc in enumerate(docs):
        (tmp_path / "c" / f"{i}.txt").write_text(doc)
    data = text_files(str(tmp_path / "c"), block_size=4, pattern="*.txt", pack=False)
    samples = [data.train[i] for i in range(len(data.train))] + [data.val[0]]
    texts = [bytes(s["input_ids"].tolist()).decode() for s in samples]
    assert texts == ["xxxx", "x", "yyyy", "yyyy", "yyyy", "zzz", "wwww", "wwww", "w"]
    batch = data.collate_fn(samples[:2])
    assert batch["labels"][1].tolist() == [ord("x"), -100, -100, -100]


# ------------------------------------------------------------------ processes at once


def builder(root: Path, cache: Path, *args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "tests.helpers.cache_builder", str(root), str(cache), *args]
    return subprocess.Popen(
        command, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def wait_ready(proc: subprocess.Popen) -> None:
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == b"ready", proc.communicate()


@pytest.mark.slow
def test_racing_processes_build_once(tmp_path: Path) -> None:
    """Four runs of a sweep start together on a corpus with no cache: one builds (about 4 s),
    the others wait for it and read what it built."""
    write_corpus(tmp_path / "c", files=12)
    cache = tmp_path / "cache"
    cache.mkdir()
    procs = [builder(tmp_path / "c", cache, "0.3") for _ in range(4)]
    for proc in procs:
        wait_ready(proc)
    (cache / "go").touch()
    outputs = [proc.communicate(timeout=HANG)[0].decode() for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), outputs
    builders = [out for out in outputs if "runner: tokenizing" in out]
    assert len(builders) == 1, outputs
    pid = procs[outputs.index(builders[0])].pid
    waiters = [out for out in outputs if f"waiting for pid {pid} on" in out]
    assert waiters, outputs  # they did meet the build under way (a late one just reads it)
    found = {out.strip().splitlines()[-1] for out in outputs}  # path and build time
    assert len(found) == 1 and len(list(cache.glob("*.building-*"))) == 0


@pytest.mark.slow
def test_a_killed_build_is_never_served(tmp_path: Path) -> None:
    texts = write_corpus(tmp_path / "c", files=40)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "go").touch()
    proc = builder(tmp_path / "c", cache, "0.1", "1")
    wait_ready(proc)
    deadline = time.time() + HANG
    while not any(p.stat().st_size for p in cache.glob("*.building-*/tokens.bin")):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = list(cache.glob("*.building-*"))
    assert len(left) == 1 and not [p for p in cache.iterdir() if p.is_dir() and p not in left]
    from tests.helpers.slow_tokenizer import SlowBytes

    found = token_cache.open_cache(
        tmp_path / "c", "*.txt", load_tokenizer(SlowBytes(0.1)), "text", str(cache)
    )
    assert stream(found).astype(np.uint8).tobytes() == "\n\n".join(texts).encode()
    assert not list(cache.glob("*.building-*"))  # the killed build's leftovers went


@pytest.mark.slow
def test_a_full_disk_leaves_nothing(tmp_path: Path) -> None:
    write_corpus(tmp_path / "c", files=4, words=20_000)  # ~0.5 MB of text, ~1 MB of tokens
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "go").touch()
    proc = builder(tmp_path / "c", cache, "0", "65536", str(256 << 10))
    out = proc.communicate(timeout=HANG)[0].decode()
    assert proc.returncode != 0
    assert "writing the token cache" in out and "nothing was kept" in out, out
    assert [p.name for p in cache.iterdir() if p.is_dir()] == []
    assert len(open_bytes(tmp_path / "c", cache).meta["files"]) == 4  # room again: it builds


@pytest.mark.slow
def test_a_damaged_cache_is_rebuilt_or_named(tmp_path: Path) -> None:
    texts = write_corpus(tmp_path / "c")
    cache = open_bytes(tmp_path / "c", tmp_path / "cache")
    with open(cache.tokens_file, "r+b") as f:
        f.truncate(10)
    rebuilt = open_bytes(tmp_path / "c", tmp_path / "cache")  # a logged warning, then a build
    assert rebuilt.meta["built"]["at"] > cache.meta["built"]["at"]
    assert stream(rebuilt).astype(np.uint8).tobytes() == "\n\n".join(texts).encode()

    with open(rebuilt.tokens_file, "r+b") as f:  # same size, another byte: the checksum sees it
        f.seek(5)
        f.write(b"\xff")
    again = open_bytes(tmp_path / "c", tmp_path / "cache")  # written into: read back, rebuilt
    assert again.meta["built"]["at"] > rebuilt.meta["built"]["at"]
    assert stream(again).astype(np.uint8).tobytes() == "\n\n".join(texts).encode()

    before = again.tokens_file.stat()  # bit rot: another byte, the file's time kept
    with open(again.tokens_file, "r+b") as f:
        f.seek(5)
        f.write(b"\xff")
    os.utime(again.tokens_file, ns=(before.st_atime_ns, before.st_mtime_ns))
    rebuilt = again
    args = [f"data.root={tmp_path / 'c'}", f"data.cache_dir={tmp_path / 'cache'}"]
    run = subprocess.run(
        [*runner_command("prepare", "data=text", *args), "--verify"],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    assert run.returncode == 1 and f"damaged: {rebuilt.tokens_file}" in run.stderr, run.stderr
    run = subprocess.run(
        [*runner_command("prepare", "data=text", *args), "--rebuild", "--verify"],
        cwd=tmp_path,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    assert run.returncode == 0 and "verified" in run.stdout, run.stdout + run.stderr
    assert f"{len(''.join(texts)) + 4:,} tokens" in run.stdout and "built in" in run.stdout


def test_a_bad_corpus_is_rejected_before_any_rank_starts(tmp_path: Path) -> None:
    """What only reading the files tells: the launcher's preparation refuses it, no rank."""
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / "a.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    found = refused("data=text", f"data.root={tmp_path / 'j'}", "data.pattern=*.jsonl")
    assert "a.jsonl, line 2: no text in data.text_field='text'" in found


@pytest.mark.slow
def test_prepare_then_train_reads_the_same_cache(cli, tmp_path: Path) -> None:
    def prepare(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            runner_command("prepare", *args),
            cwd=tmp_path,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=HANG,
        )

    typed = prepare()  # as a user types it: the default data keeps no cache
    assert typed.returncode == 0 and "data=digits keeps no cache" in typed.stdout + typed.stderr
    write_corpus(tmp_path / "c", files=4, words=400)
    where = tmp_path / "cache"
    data = ["data=text", f"data.root={tmp_path / 'c'}", f"data.cache_dir={where}"]
    run = prepare(*data)
    assert run.returncode == 0, run.stdout + run.stderr
    path = run.stdout.splitlines()[0].removeprefix("token cache: ")
    assert Path(path).parent == where and "built in" in run.stdout
    result = cli(
        *data, "model=gpt", "model.n_layer=1", "model.n_embd=16", "model.n_head=2",
        "loss=causal_lm", "metrics=language_model", "data.block_size=16",
        "global_batch_size=8", "max_epochs=null", "max_steps=3", "progress_bar=false",
    )  # fmt: skip
    assert result.returncode == 0, result.output
    assert f"runner: data: token cache {path} (" in result.stderr
    assert "tokenizing" not in result.output  # found, not built again


@pytest.mark.slow
def test_loader_workers_read_the_same_batches(tmp_path: Path) -> None:
    """The datasets pickle into DataLoader workers, which open the token file themselves."""
    from runner.data.loaders import build_train_loader
    from runner.data.sampler import GlobalBatchSampler

    write_corpus(tmp_path / "c", files=3, words=600)
    for ragged in ({}, {"min_length": 3}, {"pack": False}):
        data = text_files(str(tmp_path / "c"), block_size=16, pattern="*.txt", **ragged)
        batches = []
        for workers in (0, 2):
            sampler = GlobalBatchSampler(len(data.train), 8, 1, 0, seed=1)
            loader = build_train_loader(data.train, sampler, workers, collate_fn=data.collate_fn)
            batches.append([batch for batch, _ in loader])
        assert len(batches[0]) == len(batches[1]) > 3
        for a, b in zip(*batches, strict=True):
            assert all(torch.equal(a[k], b[k]) for k in a), ragged


def test_a_cache_beside_the_data_is_not_part_of_it(tmp_path: Path) -> None:
    """data.cache_dir=${data.root}/.cache with a pattern that would match the cache's own
    files (meta.json): the corpus stays what it was, and the cache is found again."""
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a.json").write_text('{"text": "hello"}\n')
    first = open_bytes(tmp_path / "c", tmp_path / "c" / ".cache", "**/*.json")
    again = open_bytes(tmp_path / "c", tmp_path / "c" / ".cache", "**/*.json")
    assert first.path == again.path and len(again.meta["files"]) == 1
