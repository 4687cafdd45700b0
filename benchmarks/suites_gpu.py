"""Suites about the device and the compiler: runner against torchrun + plain DDP on the GPU(s),
torch.compile against eager, and grad_accum=auto against a fixed split."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
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

GPU_BATCH = {"resnet50": 128, "gpt": 16}  # global batch: images, or 1024-token sequences
GPT_SHAPE = {"block_size": 1024, "n_layer": 12, "n_head": 12, "n_embd": 768}


def cuda_devices() -> int:
    import torch

    if torch.cuda.is_available() and not GPU_NAME:
        GPU_NAME.append(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
    return torch.cuda.device_count()


def gpu_rows(model: str, steps: int, corpus: Path) -> list[Config]:
    """Plain DDP and runner training `model` in bf16 on every visible GPU (nccl)."""
    gpus, batch = cuda_devices(), GPU_BATCH[model]
    per_item = GPT_SHAPE["block_size"] if model == "gpt" else 1  # tokens per sample
    if model == "gpt":
        plain_args = [f"--{k.replace('_', '-')}={v}" for k, v in GPT_SHAPE.items()]
        runner_args = ["model=gpt", "data=text", f"data.root={corpus}", "loss=causal_lm"]
        runner_args += ["metrics=language_model", f"data.block_size={GPT_SHAPE['block_size']}"]
        runner_args += [f"model.{k}={v}" for k, v in GPT_SHAPE.items() if k != "block_size"]
    else:
        plain_args = ["--image-size=224", "--channels-last"]
        runner_args = ["model=resnet50", "data=synthetic", "data.image_size=224"]
        runner_args += ["model.channels_last=true"]
    plain_args += [f"--model={model}", "--device=cuda", "--precision=bf16"]
    plain_args += [f"--global-batch-size={batch}"]
    runner_args += ["device=cuda", "precision=bf16", f"global_batch_size={batch}"]
    runner_args += ["eval_interval=1000000", "checkpoint.interval=null"]

    def with_items(result: dict[str, float]) -> dict[str, float]:
        return {STEP: result[STEP], ITEMS: result[SPS] * per_item, STATE: result[STATE]}

    plain = Config(
        f"torchrun + plain PyTorch DDP, {model}",
        lambda: with_items(run_plain(*plain_args, nproc=gpus, steps=steps)),
    )
    ours = Config(
        f"runner, {model}",
        lambda: with_items(run_runner(*runner_args, nproc=gpus, steps=steps)),
        baseline=plain.name,
    )
    return [plain, ours]


def random_corpus(characters: int) -> Path:
    """A directory with one text file of random letters (byte tokens for runner's gpt)."""
    import random

    corpus = Path(tempfile.mkdtemp(prefix="runner-bench-corpus-"))
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz      \n"
    (corpus / "random.txt").write_text("".join(rng.choice(letters) for _ in range(characters)))
    return corpus


def gpu_suite(steps: int) -> list[Config]:
    if cuda_devices() == 0:
        sys.exit("the gpu suite needs a CUDA device; none is visible")
    corpus = random_corpus(2_500_000)
    return [*gpu_rows("resnet50", steps, corpus), *gpu_rows("gpt", steps, corpus)]


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
