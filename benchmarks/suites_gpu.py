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

import yaml
from harness import (
    FIRST,
    GPU_NAME,
    ITEMS,
    MB,
    RESNET,
    SPS,
    STATE,
    STEP,
    WARMUP,
    Config,
    plain_command,
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


# --- issue 61: past a plain script on one GPU ------------------------------------------------

WIDE_SHAPE = {"block_size": 1024, "n_layer": 24, "n_head": 16, "n_embd": 2048}
MFU, GPU_MB = "MFU", "peak GPU MB"


def _gpt_flops(shape: dict[str, int]) -> float:
    """Training FLOPs per token of runner's gpt of `shape` (its own count, attention in)."""
    import torch

    from runner.models.gpt import GPT

    with torch.device("meta"):
        model = GPT(256, shape["block_size"], shape["n_layer"], shape["n_head"], shape["n_embd"])
    return float(model.flops_per_token())


def _with_mfu(result: dict[str, float], tokens: int, flops: float) -> dict[str, float]:
    """A row's figures: s/step, tokens/s, MFU against the GPU's bf16 peak (float8 rows too,
    torchtitan's convention), peak GPU memory."""
    from runner.hardware import peak_tflops

    items = result[SPS] * tokens
    peak = peak_tflops(GPU_NAME[0] if GPU_NAME else "", "bf16")
    mfu = items * flops / (peak * 1e12) if peak else float("nan")
    return {STEP: result[STEP], ITEMS: items, MFU: mfu, GPU_MB: result[GPU_MB]}


# Both arms alike: GPU_WARMUP steps left out (compiling, autotuning, the allocator's first
# requests), then at least GPU_TIMED steps timed, the same shapes, runner with a user's
# defaults (its tracker, opened before the first step). The plain script synchronizes the
# device at both ends of its span; runner's span is its records': one at the warm-up's end,
# one every GPU_WARMUP steps after, each timed from the last (a log step reduces its record,
# which waits for the device: each end of the span follows the device's work alike).
GPU_WARMUP, GPU_TIMED = 20, 100


def runner_gpu(*overrides: str, steps: int) -> dict[str, float]:
    """One runner run on every GPU: s/step and samples/s over the steps after the warm-up
    (its records), the largest peak of GPU memory a record gave, and where a step's time
    went (time/...: its records', ms a step)."""
    steps = max(steps, GPU_WARMUP + GPU_TIMED)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        command = [venv_tool("runner"), *overrides, f"nproc={cuda_devices()}", f"max_steps={steps}"]
        command += ["max_epochs=null", f"log_interval={GPU_WARMUP}", "progress_bar=false"]
        run([*command, f"hydra.run.dir={run_dir}"], thread_env(cuda_devices()), cwd=tmp)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
        batch = yaml.safe_load((run_dir / "config.yaml").read_text())["global_batch_size"]
    later = [r for r in records if r["step"] > GPU_WARMUP]
    seconds = statistics.fmean(r["time/step_s"] for r in later)
    peak = max(r.get("memory/peak_mb", 0.0) for r in records)
    return {STEP: seconds, SPS: batch / seconds, GPU_MB: peak}


def plain_gpu(*args: str, steps: int, script: str) -> dict[str, float]:
    """One plain script on every GPU, with its peak of GPU memory."""
    steps = max(steps, GPU_WARMUP + GPU_TIMED)
    command = plain_command(
        *args, nproc=cuda_devices(), steps=steps, warmup=GPU_WARMUP, script=script
    )
    result = json.loads(run(command, thread_env(cuda_devices())).strip().splitlines()[-1])
    batch = int(next(a.split("=")[1] for a in args if a.startswith("--global-batch-size")))
    seconds = result["sec_per_step"]
    return {STEP: seconds, SPS: batch / seconds, GPU_MB: result["peak_gpu_bytes"] / MB}


def speed_gpt_rows(
    steps: int, corpus: Path, shape: dict[str, int], batch: int, ways: tuple[str, ...]
) -> list[Config]:
    """The gpt of `shape` at global `batch`, bf16: nanoGPT's way eager and compiled, and
    runner each of `ways` (eager, compiled, reduce-overhead, float8: tensorwise with
    compile), each against the plain script of its kind (compiled for all but eager)."""
    tokens, flops = shape["block_size"], _gpt_flops(shape)
    size = f"gpt {shape['n_layer']}x{shape['n_embd']}, batch {batch}"
    plain_args = [f"--{k.replace('_', '-')}={v}" for k, v in shape.items()]
    plain_args += ["--device=cuda", f"--global-batch-size={batch}"]
    ours = ["model=gpt", "data=text", f"data.root={corpus}", "loss=causal_lm"]
    ours += ["metrics=language_model", f"data.block_size={tokens}", "device=cuda"]
    ours += [f"model.{k}={v}" for k, v in shape.items() if k != "block_size"]
    ours += [f"global_batch_size={batch}", *QUIET]
    kinds = {
        "eager": ["precision=bf16"],
        "compiled": ["precision=bf16", "compile=true"],
        "reduce-overhead": ["precision=bf16", "compile={mode:reduce-overhead}"],
        "float8": ["precision=float8", "compile=true"],
        "fsdp": ["precision=bf16", "parallelism=fsdp"],
    }

    def plain(*extra: str) -> Config:
        name = f"plain {size}" + "".join(f" {e.lstrip('-')}" for e in extra)
        return Config(
            name,
            lambda: _with_mfu(
                plain_gpu(*plain_args, *extra, steps=steps, script="plain_gpt.py"), tokens, flops
            ),
        )

    eager, compiled = plain(), plain("--compile")
    eager.baseline, compiled.baseline = eager.name, compiled.name
    of_its_own: dict[str, Config] = {}  # the plain rows some ways need besides those two
    if "fsdp" in ways:  # fsdp against FSDP2 by hand (bf16 parameters), not against ddp
        of_its_own["fsdp"] = plain("--engine=fsdp")
        of_its_own["fsdp"].baseline = of_its_own["fsdp"].name
    if "float8" in ways:
        of_its_own["float8"] = plain("--compile", "--float8=tensorwise")
        of_its_own["float8"].baseline = compiled.name
    # each runner row right after the plain rows it is compared with: a budget that cuts the
    # suite short still leaves pairs
    rows: list[Config] = []
    for way in ways:
        against = {"eager": eager, "fsdp": of_its_own.get("fsdp")}.get(way, compiled)
        for needed in (against, of_its_own.get(way)):
            if needed is not None and all(needed is not r for r in rows):
                rows.append(needed)
        overrides = [*ours, *kinds[way]]
        rows.append(
            Config(
                f"runner {size}, {way}",
                lambda overrides=overrides: _with_mfu(
                    runner_gpu(*overrides, steps=steps), tokens, flops
                ),
                baseline=against.name if against is not None else compiled.name,
            )
        )
    return rows


def dle_resnet_rows(steps: int) -> list[Config]:
    """resnet50 at 224 px, channels_last, bf16: a plain script in the style of NVIDIA's
    DeepLearningExamples (one synthetic batch made on the device) against runner."""
    gpus = cuda_devices()
    plain_args = ["--model=resnet50", "--image-size=224", "--channels-last", "--device=cuda"]
    plain_args += ["--precision=bf16", f"--global-batch-size={RESNET_BATCH}", "--data-on-device"]
    ours = ["model=resnet50", "data=synthetic", "data.image_size=224", "device=cuda"]
    ours += ["model.channels_last=true", "precision=bf16", f"global_batch_size={RESNET_BATCH}"]

    def images(result: dict[str, float]) -> dict[str, float]:
        return {STEP: result[STEP], ITEMS: result[SPS], MFU: float("nan"), GPU_MB: result[GPU_MB]}

    plain = Config(
        f"plain resnet50, DeepLearningExamples' way ({gpus} GPU)",
        lambda: images(plain_gpu(*plain_args, steps=steps, script="plain_ddp.py")),
    )
    plain.baseline = plain.name
    runner = Config(
        "runner resnet50",
        lambda: images(runner_gpu(*ours, *QUIET, steps=steps)),
        baseline=plain.name,
    )
    return [plain, runner]


def gpu_speed_suite(steps: int) -> list[Config]:
    """Issue 61's one run: the gpt 12x768 at batch 16 and 32 (eager, compiled,
    reduce-overhead, float8 with compile), a 24x2048 gpt at batch 8 (compiled, float8), and
    resnet50 against DeepLearningExamples' way."""
    _need_cuda()
    corpus = random_corpus(2_500_000)
    import importlib.util

    float8 = ("float8",) if importlib.util.find_spec("torchao") else ()
    if not float8:
        print("gpu_speed: torchao is not installed: no float8 rows", file=sys.stderr)
    every = ("eager", "compiled", "reduce-overhead", "fsdp", *float8)
    rows: list[Config] = []
    for batch in (16, 32):
        rows += speed_gpt_rows(steps, corpus, GPT_SHAPE, batch, every)
    rows += speed_gpt_rows(steps, corpus, WIDE_SHAPE, 8, ("compiled", *float8))
    return [*rows, *dle_resnet_rows(steps)]
