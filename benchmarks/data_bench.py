"""The data suites of `make bench`: a corpus of any size, tokenization, the token loader.

Corpora are made by the bench (text of Zipf-distributed pseudo-words, 16 MB files), once,
under RUNNER_BENCH_DATA (default: <tmp>/runner-bench-data), with the token caches the
runs build (RUNNER_CACHE_DIR is set there too).

- data_scale: per-rank peak RSS and time to first step of a small gpt on warm caches of
  10 MB, 100 MB and 1 GB corpora; ratios against the 10 MB corpus (flat is the goal).
- tokenize: MB/s of text turned into a token file, both cores, `runner prepare` against a
  plain script that batch-encodes with the same Hugging Face tokenizer.
- token_loader: tokens/s of training batches, runner's loader against nanoGPT's get_batch.
- image_folder: images/s of data=image_folder's training pipeline (both decoders) against a
  plain torchvision ImageFolder + DataLoader script with the same workers.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from harness import FIRST, MB, REPO, Config, run, thread_env, time_command, venv_tool

HOME = Path(os.environ.get("RUNNER_BENCH_DATA", Path(tempfile.gettempdir()) / "runner-bench-data"))
CACHES = HOME / "caches"
SIZES = {"10 MB": 10**7, "100 MB": 10**8, "1 GB": 10**9}
FILE_BYTES = 16 * 10**6
RSS = "peak RSS MB/rank"
TEXT_RATE = "MB/s of text"
TOKEN_RATE = "M tokens/s"
GPT = ["model=gpt", "model.n_layer=2", "model.n_head=2", "model.n_embd=64"]
GPT += ["loss=causal_lm", "metrics=language_model", "data=text", "data.block_size=256"]
GPT += ["global_batch_size=16", "max_epochs=null", "max_steps=3", "eval_batches=1"]
GPT += ["progress_bar=false", "nproc=2"]


def environment() -> dict[str, str]:
    return {**thread_env(2), "RUNNER_CACHE_DIR": str(CACHES)}


def corpus(size: int) -> Path:
    """A folder of `size` bytes of text in FILE_BYTES files, made once."""
    root = HOME / f"corpus-{size}"
    if (root / "complete").exists():
        return root
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"etaoinshrdlcumwfgypbvkjxqz", np.uint8)
    words = [bytes(rng.choice(letters, rng.integers(1, 10))) for _ in range(20_000)]
    spaced = np.array([w + b" " for w in words] + [w + b"\n" for w in words], dtype=object)
    weights = 1.0 / np.arange(1, len(words) + 1)  # Zipf: a few words are most of the text
    weights /= weights.sum()
    written, index = 0, 0
    while written < size:
        chunk = bytearray()
        while len(chunk) < min(FILE_BYTES, size - written):
            picks = rng.choice(len(words), 200_000, p=weights)
            picks += len(words) * (rng.random(len(picks)) < 1 / 12)  # a line per ~12 words
            chunk += b"".join(spaced[picks].tolist())
        chunk = chunk[: min(FILE_BYTES, size - written)]
        (root / f"part{index:04d}.txt").write_bytes(bytes(chunk))
        written, index = written + len(chunk), index + 1
    (root / "complete").touch()
    return root


def tokenizer_file() -> Path:
    """A byte-level BPE of 8,192 ids trained on the 10 MB corpus, made once."""
    path = HOME / "bpe-8192.json"
    if not path.exists():
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = trainers.BpeTrainer(
            vocab_size=8192,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        files = sorted(str(p) for p in corpus(SIZES["10 MB"]).glob("*.txt"))
        tok.train(files, trainer)
        tok.save(str(path))
    return path


def prepare(root: Path, *extra: str) -> tuple[float, str]:
    """`runner prepare` from outside: (wall seconds, its stdout)."""
    command = [venv_tool("runner"), "prepare", "data=text", f"data.root={root}", *extra]
    with tempfile.TemporaryDirectory() as tmp:
        start = time.time()
        stdout = run(command, environment(), cwd=tmp)
        return time.time() - start, stdout


# --- data_scale ----------------------------------------------------------------------


def scale_row(label: str, root: Path) -> Config:
    def measure() -> dict[str, float]:
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            command = [venv_tool("runner"), *GPT, f"data.root={root}", f"hydra.run.dir={run_dir}"]
            _, start, _ = time_command(command, tmp, 2)
            summary = json.loads((run_dir / "summary.json").read_text())
        return {FIRST: summary["first_step_at"] - start, RSS: max(summary["peak_rss_bytes"]) / MB}

    return Config(f"runner gpt, {label} corpus", measure, "runner gpt, 10 MB corpus")


def scale_suite(_steps: int) -> list[Config]:
    rows = []
    for label, size in SIZES.items():
        root = corpus(size)
        prepare(root)  # the cache is warm before any timed run
        rows.append(scale_row(label, root))
    os.sync()  # and every file written out: no write-back under the first timed run
    return rows


# --- tokenize ------------------------------------------------------------------------


def tokenize_suite(_steps: int) -> list[Config]:
    root, tokenizer = corpus(SIZES["100 MB"]), tokenizer_file()
    text_mb = sum(p.stat().st_size for p in root.glob("*.txt")) / 1e6

    def plain() -> dict[str, float]:
        with tempfile.TemporaryDirectory() as tmp:
            script = [sys.executable, str(REPO / "benchmarks" / "plain_tokenize.py")]
            command = [*script, str(root), str(tokenizer), f"{tmp}/tokens.bin"]
            wall, _, _ = time_command(command, tmp, 1)
        return {TEXT_RATE: text_mb / wall}

    def ours() -> dict[str, float]:
        with tempfile.TemporaryDirectory() as tmp:
            wall, _ = prepare(root, f"data.tokenizer={tokenizer}", f"data.cache_dir={tmp}")
        return {TEXT_RATE: text_mb / wall}

    baseline = "plain script: tokenizers encode_batch_fast, uint16 file"
    return [Config(baseline, plain), Config("runner prepare", ours, baseline)]


# --- token_loader --------------------------------------------------------------------


def loader_suite(_steps: int) -> list[Config]:
    root = corpus(SIZES["1 GB"])
    _, stdout = prepare(root)
    cache = stdout.splitlines()[0].removeprefix("token cache: ")

    def row(implementation: str) -> Config:
        def measure() -> dict[str, float]:
            script = str(REPO / "benchmarks" / "loader_throughput.py")
            out = run([sys.executable, script, implementation, cache], thread_env(1))
            return {TOKEN_RATE: json.loads(out.strip().splitlines()[-1])["tokens_per_s"] / 1e6}

        return Config(LOADERS[implementation], measure, LOADERS["nanogpt"])

    return [row(name) for name in LOADERS]


# --- image_folder --------------------------------------------------------------------

IMAGES, IMAGE_RATE = 1000, "images/s"


def image_folder() -> Path:
    """IMAGES JPEGs of 500 x 375 (ImageNet's typical size, quality 90) in 10 classes, with a
    small val split; smooth gradients and noise, so they decode like photographs."""
    root = HOME / "images"
    if (root / "complete").exists():
        return root
    from PIL import Image

    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:375, 0:500]
    for split, count in (("train", IMAGES), ("val", 20)):
        for i in range(count):
            folder = root / split / f"class{i % 10}"
            folder.mkdir(parents=True, exist_ok=True)
            a, b = rng.uniform(5, 40, 2)
            planes = [np.sin(x / a) * 127 + 128, np.cos(y / b) * 127 + 128, (x + y + i) % 256]
            pixels = np.stack(planes, -1) + rng.normal(0, 20, (375, 500, 3))
            image = Image.fromarray(pixels.clip(0, 255).astype(np.uint8))
            image.save(folder / f"{i:05d}.jpg", quality=90)
    (root / "complete").touch()
    return root


def image_suite(_steps: int) -> list[Config]:
    root = image_folder()

    def row(implementation: str) -> Config:
        def measure() -> dict[str, float]:
            script = str(REPO / "benchmarks" / "image_throughput.py")
            out = run([sys.executable, script, implementation, str(root), "2"], thread_env(1))
            return {IMAGE_RATE: json.loads(out.strip().splitlines()[-1])["images_per_s"]}

        return Config(IMAGE_PIPELINES[implementation], measure, IMAGE_PIPELINES["plain"])

    return [row(name) for name in IMAGE_PIPELINES]


IMAGE_PIPELINES = {
    "plain": "plain script: ImageFolder (Pillow) + DataLoader",
    "runner-pil": "runner data=image_folder data.decoder=pil",
    "runner": "runner data=image_folder (decoder=torchvision, the default)",
}

LOADERS = {
    "nanogpt": "nanoGPT get_batch (memmap per batch, x and y)",
    "nanogpt-x": "nanoGPT get_batch, x only",
    "runner": "runner: DataLoader over the token cache (the trainer's path)",
}

DATA_SUITES = {
    "data_scale": (
        "Data at scale: a gpt (2 layers, 64 wide) on byte tokens of 10 MB, 100 MB and 1 GB "
        "corpora, warm token caches, 256-token blocks, nproc=2, global batch 16, 3 steps; "
        "ratios against the 10 MB corpus",
        scale_suite,
    ),
    "tokenize": (
        "Tokenization: 100 MB of text in 16 MB files, a byte-level BPE of 8,192 ids, both "
        "cores; from outside (start-up included); ratios against a plain tokenizers script",
        tokenize_suite,
    ),
    "token_loader": (
        "Token loader: batches of 32 x 1024 tokens from a 1 GB corpus's 2 GB uint16 token file "
        "(page cache warm), one process, 1 thread; ratios against nanoGPT's get_batch",
        loader_suite,
    ),
    "image_folder": (
        f"Image input pipeline: {IMAGES} JPEGs of 500 x 375, RandomResizedCrop(224) + "
        "horizontal flip + normalize, batches of 64, 2 DataLoader workers, one process; "
        "ratios against a plain torchvision ImageFolder + DataLoader script",
        image_suite,
    ),
}
DATA_RATIO_METRICS = (RSS, TEXT_RATE, TOKEN_RATE, IMAGE_RATE)
# How each suite measures, for its table's header.
DATA_HOW = {
    "data_scale": "each run timed from outside: its start to rank 0's first optimizer step done "
    "(summary.json first_step_at); peak RSS from summary.json",
    "tokenize": "MB of text / wall seconds of the whole command (runner prepare: parent, config "
    "check, child; a fresh cache directory each time)",
    "token_loader": "2,000 batches after 50 warmup batches, the process's own clock",
    "image_folder": "two epochs after a warm-up epoch (workers up, files in the page cache), "
    "the process's own clock",
}
