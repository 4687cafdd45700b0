"""Suites about the device and the compiler: runner against torchrun + plain DDP on the GPU(s),
torch.compile against eager, and grad_accum=auto against a fixed split."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from harness import (
    FIRST,
    GPU_NAME,
    ITEMS,
    RESNET,
    SPS,
    STATE,
    STEP,
    WARMUP,
    Config,
    run,
    run_plain,
    run_runner,
    runner_row,
    thread_env,
    venv_tool,
)

GPT_SHAPE = {"block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768}
RESNET_BATCH = 128  # images a step, all GPUs together


def cuda_devices() -> int:
    import torch

    if torch.cuda.is_available() and not GPU_NAME:
        GPU_NAME.append(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
    return torch.cuda.device_count()


def _items(per_item: int) -> Callable[[dict[str, float]], dict[str, float]]:
    """images or tokens a second from a run's samples a second (`per_item` each)."""

    def with_items(result: dict[str, float]) -> dict[str, float]:
        return {STEP: result[STEP], ITEMS: result[SPS] * per_item, STATE: result[STATE]}

    return with_items


def resnet_rows(steps: int) -> list[Config]:
    """resnet50 on 224px images, bf16, channels_last, every GPU: torchrun + plain DDP (its
    batches cut from the in-memory images in one indexing op and pinned, as runner's loader
    does) and runner."""
    gpus, items = cuda_devices(), _items(1)
    plain_args = ["--model=resnet50", "--image-size=224", "--channels-last", "--device=cuda"]
    plain_args += ["--precision=bf16", f"--global-batch-size={RESNET_BATCH}"]
    runner_args = ["model=resnet50", "data=synthetic", "data.image_size=224"]
    runner_args += ["model.channels_last=true", "device=cuda", "precision=bf16"]
    runner_args += [f"global_batch_size={RESNET_BATCH}", *QUIET]
    plain = Config(
        "torchrun + plain PyTorch DDP, resnet50",
        lambda: items(run_plain(*plain_args, nproc=gpus, steps=steps)),
    )
    plain.baseline = plain.name
    ours = Config(
        "runner, resnet50",
        lambda: items(run_runner(*runner_args, nproc=gpus, steps=steps)),
        baseline=plain.name,
    )
    return [plain, ours]


QUIET = ["eval_interval=1000000", "checkpoint.interval=null"]  # no evaluation, no checkpoint


def gpt_rows(steps: int, corpus: Path, batch: int, compiled: bool = False) -> list[Config]:
    """The 12-layer gpt on 1024-token blocks, bf16, every GPU: nanoGPT's way (plain_gpt.py:
    tokens on the device, fused AdamW) as the baseline, torchrun + plain DDP on runner's data
    path beside it, and runner (ddp; fsdp too when eager)."""
    gpus, items = cuda_devices(), _items(GPT_SHAPE["block_size"])
    shape = [f"--{k.replace('_', '-')}={v}" for k, v in GPT_SHAPE.items()]
    suffix = f"gpt, batch {batch}" + (", compiled" if compiled else "")
    nano_args = [*shape, "--device=cuda", f"--global-batch-size={batch}"]
    nano_args += ["--compile"] if compiled else []
    nano = Config(
        f"plain gpt, nanoGPT's way, {suffix}",
        lambda: items(run_plain(*nano_args, nproc=gpus, steps=steps, script="plain_gpt.py")),
    )
    nano.baseline = nano.name
    runner_args = ["model=gpt", "data=text", f"data.root={corpus}", "loss=causal_lm"]
    runner_args += ["metrics=language_model", f"data.block_size={GPT_SHAPE['block_size']}"]
    runner_args += [f"model.{k}={v}" for k, v in GPT_SHAPE.items() if k != "block_size"]
    runner_args += ["device=cuda", "precision=bf16", f"global_batch_size={batch}", *QUIET]
    runner_args += ["compile=true"] if compiled else []
    rows = [
        nano,
        Config(
            f"runner ddp, {suffix}",
            lambda: items(run_runner(*runner_args, nproc=gpus, steps=steps)),
            baseline=nano.name,
        ),
    ]
    if not compiled:
        plain_args = [*shape, "--model=gpt", "--device=cuda", "--precision=bf16"]
        plain_args += [f"--global-batch-size={batch}"]
        plain = Config(
            f"torchrun + plain PyTorch DDP, {suffix}",
            lambda: items(run_plain(*plain_args, nproc=gpus, steps=steps)),
            baseline=nano.name,
        )
        fsdp = Config(
            f"runner fsdp, {suffix} (ratio: against runner ddp)",
            lambda: items(run_runner(*runner_args, "parallelism=fsdp", nproc=gpus, steps=steps)),
            baseline=rows[1].name,
        )
        rows += [plain, fsdp]
    return rows


def random_corpus(characters: int) -> Path:
    """A directory with one text file of random letters (byte tokens for runner's gpt)."""
    import random

    corpus = Path(tempfile.mkdtemp(prefix="runner-bench-corpus-"))
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz      \n"
    (corpus / "random.txt").write_text("".join(rng.choice(letters) for _ in range(characters)))
    return corpus


def _need_cuda() -> None:
    if cuda_devices() == 0:
        sys.exit("the gpu suites need a CUDA device; none is visible")


def gpu_suite(steps: int) -> list[Config]:
    """resnet50 and the gpt at batch 16, eager: the first look at a GPU."""
    _need_cuda()
    return [*resnet_rows(steps), *gpt_rows(steps, random_corpus(2_500_000), 16)]


def gpu_gpt_suite(steps: int) -> list[Config]:
    """Per-step parity on a GPU: the gpt at batch 16 and 32, eager and compiled, against
    nanoGPT's way; fsdp on the same GPUs against ddp."""
    _need_cuda()
    corpus = random_corpus(2_500_000)
    rows: list[Config] = []
    for compiled in (False, True):
        for batch in (16, 32):
            rows += gpt_rows(steps, corpus, batch, compiled)
    return rows


# --- compile: time to first step and step time, eager against torch.compile --------------

COMPILE_S = "compile s"
COMPILE_GPT = ["model=gpt", "model.n_layer=4", "model.n_embd=128", "data=text"]
COMPILE_GPT += ["data.block_size=256", "loss=causal_lm", "metrics=language_model"]
COMPILE_GPT += ["global_batch_size=8", "eval_interval=1000000"]


def compile_row(name: str, extra: tuple[str, ...], steps: int, corpus: Path) -> Config:
    """One run: s/step after the warmup (own clocks), seconds from the command's start to
    the first step done, and summary.json's compile_s. A fresh inductor cache each run
    (TORCHINDUCTOR_CACHE_DIR), so the compile is paid in full as on a first run."""

    def measure() -> dict[str, float]:
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            command = [venv_tool("runner"), *COMPILE_GPT, f"data.root={corpus}", "nproc=2"]
            command += [f"max_steps={steps}", "max_epochs=null", f"log_interval={WARMUP}"]
            command += ["progress_bar=false", *extra, f"hydra.run.dir={run_dir}"]
            env = {**thread_env(2), "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor")}
            start = time.time()
            run(command, env, cwd=tmp)
            summary = json.loads((run_dir / "summary.json").read_text())
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
        later = [8 / r["throughput/samples_per_sec"] for r in records if r["step"] > WARMUP]
        return {
            STEP: statistics.fmean(later),
            FIRST: summary["first_step_at"] - start,
            COMPILE_S: summary["compile_s"] or 0.0,
        }

    return Config(name, measure)


def compile_suite(steps: int) -> list[Config]:
    corpus = random_corpus(200_000)
    return [
        compile_row("runner, eager", (), steps, corpus),
        compile_row("runner compile=true (per block)", ("compile=true",), steps, corpus),
        compile_row(
            "runner compile={per_block:false} (whole model)",
            ("compile={per_block:false}",),
            steps,
            corpus,
        ),
    ]


def auto_microbatch_suite(steps: int) -> list[Config]:
    """What grad_accum=auto costs when nothing runs out of memory: one small all-reduce per
    microbatch (and, under fsdp, one before each block's forward), each read on the host."""
    corpus = random_corpus(200_000)
    gpt = [*COMPILE_GPT, f"data.root={corpus}", "parallelism=fsdp"]
    return [
        runner_row("runner ddp resnet18, grad_accum=1", (*RESNET,), steps),
        runner_row("runner ddp resnet18, grad_accum=auto", (*RESNET, "grad_accum=auto"), steps),
        Config(
            "runner fsdp gpt, grad_accum=1",
            lambda: run_runner(*gpt, nproc=2, steps=steps),
            baseline="runner fsdp gpt, grad_accum=1",
        ),
        Config(
            "runner fsdp gpt, grad_accum=auto",
            lambda: run_runner(*gpt, "grad_accum=auto", nproc=2, steps=steps),
            baseline="runner fsdp gpt, grad_accum=1",
        ),
    ]
