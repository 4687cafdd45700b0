"""Speed suites: runner's per-step overhead and time to first step against torchrun and the
plain script (B1, B2), with trackers, at start-up, in a sweep; sync strategies (B4); scaling
with the number of ranks (B5)."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from harness import (
    FIRST,
    MB,
    REPO,
    RESNET,
    SPS,
    STATE,
    STEP,
    WARMUP,
    Config,
    outside_plain,
    outside_runner,
    plain_command,
    plain_resnet,
    run,
    run_runner,
    runner_row,
    thread_env,
    time_command,
    venv_tool,
)

# steps (short, long) per model: the difference must dwarf the run-to-run noise of
# startup (about +-0.3 s here), so the mlp's ~5 ms steps need many more than resnet18's.
OVERHEAD_STEPS = {"resnet18": (20, 120), "mlp": (200, 2000)}
OVERHEAD_BATCHES = (8, 16, 32)  # per rank (2 ranks): where runner's fixed cost per step shows
# Both sides: SGD at lr 0.01 without momentum or schedule, fp32, 1 thread per rank.
SGD_RUNNER = ("optimizer=sgd", "optimizer.lr=0.01", "optimizer.momentum=0.0", "scheduler=constant")
SGD_PLAIN = ("--optimizer=sgd", "--lr=0.01")


def overhead_config(name: str, measure, model: str, baseline: str | None = None) -> Config:
    short, long = OVERHEAD_STEPS[model]

    def both() -> dict[str, float]:
        # Timed from the first step's end to the command's end: start-up's noise (+-0.3 s
        # here) stays out, and what a run does after its last step cancels in the difference.
        wall_short, first = measure(model, short)
        wall_long, first_long = measure(model, long)
        per_step = ((wall_long - first_long) - (wall_short - first)) / (long - short)
        return {STEP: per_step, FIRST: first}

    return Config(name, both, baseline)


def overhead_suite(model: str) -> Callable[[int], list[Config]]:
    """For each per-rank batch: torchrun + the plain script, and runner with its defaults
    (the hang watchdog and the non-finite guard on), compared pairwise."""

    def build(_steps: int) -> list[Config]:
        configs = []
        for per_rank in OVERHEAD_BATCHES:
            plain = f"torchrun + plain PyTorch DDP, batch {per_rank}/rank"
            batch = 2 * per_rank
            configs += [
                overhead_config(
                    plain, partial(outside_plain, batch=batch, extra=SGD_PLAIN), model, plain
                ),
                overhead_config(
                    f"runner, batch {per_rank}/rank",
                    partial(outside_runner, batch=batch, extra=SGD_RUNNER),
                    model,
                    baseline=plain,
                ),
            ]
        return configs

    return build


LAUNCHER_STEPS, LAUNCHER_LOG = 300, 20  # s/step from the records after the first 40 steps


def launcher_row(name: str, nproc: int, extra: tuple[str, ...], baseline: str) -> Config:
    """One run of resnet18 (batch 16 per rank): seconds from the command's start to its
    first optimizer step (summary.json's first_step_at), and seconds per step from the run's
    own throughput records once past the first 40 steps: the launcher's start-up and
    shutdown stay out of the per-step figure, which is the steady state a long run lives in.
    One intra-op thread per rank, so that with 1 rank a core is left over."""
    batch = 16 * nproc

    def measure() -> dict[str, float]:
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            command = [venv_tool("runner"), "model=resnet18", "data=synthetic", f"nproc={nproc}"]
            command += [f"global_batch_size={batch}", f"max_steps={LAUNCHER_STEPS}"]
            command += ["max_epochs=null", "eval_interval=1000000", f"log_interval={LAUNCHER_LOG}"]
            command += ["progress_bar=false", *SGD_RUNNER, *extra, f"hydra.run.dir={run_dir}"]
            start = time.time()
            run(command, thread_env(nproc, threads=1), cwd=tmp)  # a thread per rank
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
            first = json.loads((run_dir / "summary.json").read_text())["first_step_at"]
        steady = [
            batch / r["throughput/samples_per_sec"]
            for r in records
            if r["step"] > 2 * LAUNCHER_LOG and "throughput/samples_per_sec" in r
        ]
        return {STEP: statistics.fmean(steady), FIRST: first - start}

    return Config(name, measure, baseline)


def launchers_suite(_steps: int) -> list[Config]:
    """launcher=ray against launcher=elastic (the default), the same run: Ray Train's workers
    against runner's own ranks, a local Ray cluster started and stopped by each run. With 2
    ranks every core trains and Ray's own processes (GCS, raylet, Train's controller and
    helper actors) take their share from the ranks; with 1, a core is left to them."""
    configs = []
    for nproc, what in ((2, "2 ranks: every core trains"), (1, "1 rank: a core left over")):
        elastic = f"launcher=elastic (torch elastic), {what}"
        on_ray = f"launcher=ray (Ray Train workers, local cluster), {what}"
        configs += [
            launcher_row(elastic, nproc, (), elastic),
            launcher_row(on_ray, nproc, ("launcher=ray",), elastic),
        ]
    return configs


TRACKER_STEPS = 2000
TRACKER_WALL, TRACKER_TRAIN = "command wall s", "training wall s"


def tracker_row(logger: str) -> Config:
    """One runner run with `logger`: seconds per step once the trackers are up (the second
    half of the run, from its own throughput records), and the wall time of the command and
    of the training (summary.json), which hold the trackers' one-off costs (imports, opening
    a store, ending a run). MLflow's store is a fresh SQLite file in the run's temporary
    directory every time (its tables are created each run: the worst case)."""

    def measure() -> dict[str, float]:
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            command = [venv_tool("runner"), "model=mlp", "data=synthetic", "nproc=2"]
            command += ["global_batch_size=64", f"max_steps={TRACKER_STEPS}", "max_epochs=null"]
            command += ["eval_interval=1000000", "progress_bar=false", f"logger={logger}"]
            wall, _, _ = time_command([*command, f"hydra.run.dir={run_dir}"], tmp, 2)
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
            summary = json.loads((run_dir / "summary.json").read_text())
        later = [
            64 / r["throughput/samples_per_sec"]
            for r in records
            if r["step"] > TRACKER_STEPS // 2 and "throughput/samples_per_sec" in r
        ]
        return {
            STEP: statistics.fmean(later),
            TRACKER_TRAIN: summary["wall_time_s"],
            TRACKER_WALL: wall,
        }

    return Config(f"runner logger={logger}", measure)


def trackers_suite(_steps: int) -> list[Config]:
    loggers = ("none", "tensorboard", "csv", "mlflow", "wandb", "[tensorboard,csv,mlflow,wandb]")
    return [tracker_row(logger) for logger in loggers]


def grad_norm_suite(_steps: int) -> list[Config]:
    """What logging the global gradient norm costs where clipping does not compute it: the
    mlp at the smallest per-rank batch of B1 (where a pass over the gradients weighs most),
    at the default log_interval and at a record every step."""
    configs = []
    for interval in (10, 1):
        base = f"runner log_grad_norm=false, log_interval={interval}"
        for on in ("false", "true"):
            extra = (*SGD_RUNNER, f"log_grad_norm={on}", f"log_interval={interval}")
            name = f"runner log_grad_norm={on}, log_interval={interval}"
            measure = partial(outside_runner, batch=16, extra=extra)
            configs.append(overhead_config(name, measure, "mlp", base))
    return configs


CHECKPOINT_BLOCKED = "s blocked per checkpoint"
CHECKPOINT_WRITTEN = "s to sealed per checkpoint"  # written, digested and sealed
# A gpt of about 100 MB of training state under ddp (6.4M parameters: fp32 weights, gradients
# and AdamW's two moments), a checkpoint every 8 steps.
GPT_100MB = (
    "+recipe=gpt_text",
    "model.n_layer=2",
    "model.n_embd=512",
    "model.n_head=8",
    "data.block_size=64",
    "global_batch_size=8",
    "eval_interval=null",
    "eval_batches=1",
    "logger=[]",
    "checkpoint.interval=8",
)


def checkpoint_async_suite(_steps: int) -> list[Config]:
    """How long training waits per checkpoint, and how long each takes until it is sealed,
    for ddp and fsdp: async against sync, and the content digest (checkpoint.digest, taken
    as each file is written) against none."""

    def measure(*overrides: str) -> dict[str, float]:
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            command = [venv_tool("runner"), *GPT_100MB, *overrides, "nproc=2", "max_steps=40"]
            command += ["progress_bar=false", f"hydra.run.dir={run_dir}"]
            run(command, thread_env(2), cwd=tmp)
            summary = json.loads((run_dir / "summary.json").read_text())
        return {
            CHECKPOINT_BLOCKED: statistics.median(summary["checkpoint_blocked_s"]),
            CHECKPOINT_WRITTEN: statistics.median(summary["checkpoint_written_s"]),
            STATE: max(rank["total"] for rank in summary["state_bytes"]) / MB,
        }

    configs = []
    for parallelism in ("ddp", "fsdp"):
        bare_sync = f"{parallelism}, checkpoint.async=false, checkpoint.digest=false"
        bare_async = f"{parallelism}, checkpoint.async=true, checkpoint.digest=false"
        for name, baseline, settings in (
            (bare_sync, bare_sync, ("false", "false")),
            (f"{parallelism}, checkpoint.async=false", bare_sync, ("false", "true")),
            (bare_async, bare_sync, ("true", "false")),
            (f"{parallelism}, checkpoint.async=true", bare_async, ("true", "true")),
        ):
            overrides = (
                f"parallelism={parallelism}",
                f"checkpoint.async={settings[0]}",
                f"checkpoint.digest={settings[1]}",
            )
            configs.append(Config(name, partial(measure, *overrides), baseline))
    return configs


TOKENS_PER_S, MFU = "tokens/s", "MFU %"
SGEMM = (
    "import time, torch; torch.set_num_threads(1); a = torch.randn(2048, 2048); "
    "[a @ a for _ in range(3)]; t = time.perf_counter(); [a @ a for _ in range(20)]; "
    "print(2 * 2048**3 * 20 / (time.perf_counter() - t) / 1e12)"
)


def cpu_peak_tflops() -> float:
    """One core's fp32 matmul rate (a 2048 x 2048 sgemm, one thread, best of 3 runs): the
    peak the mfu_cpu suite declares, as no table knows a CPU's."""
    command = [sys.executable, "-c", SGEMM]
    return max(float(run(command, thread_env(1)).strip()) for _ in range(3))


def mfu_cpu_suite(_steps: int) -> list[Config]:
    """tokens/s and MFU from the run's own records (their second half) on the gpt_text
    recipe's model, against one core's measured sgemm rate as the declared peak (each rank
    has a core), for ddp and fsdp."""
    peak = cpu_peak_tflops()
    print(f"  declared peak: {peak:.4f} TFLOP/s per rank (sgemm, one core)", file=sys.stderr)

    def measure(*overrides: str) -> dict[str, float]:
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            command = [venv_tool("runner"), "+recipe=gpt_text", *overrides, "max_steps=60"]
            command += ["eval_interval=null", "eval_batches=1", "log_interval=5", "logger=[]"]
            command += [f"mfu.peak_tflops={peak:.4f}", "progress_bar=false"]
            command += [f"hydra.run.dir={run_dir}"]
            run(command, thread_env(2), cwd=tmp)
            lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        records = [r for r in map(json.loads, lines) if r["step"] > 30]
        return {
            TOKENS_PER_S: statistics.median(r["throughput/tokens_per_sec"] for r in records),
            MFU: 100 * statistics.median(r["throughput/mfu"] for r in records),
            "declared peak GFLOP/s per rank": 1000 * peak,
        }

    return [
        Config(f"runner gpt parallelism={p}", partial(measure, f"parallelism={p}"))
        for p in ("ddp", "fsdp")
    ]


# The sharded engines' per-step time: runner's gpt (4 layers, 256 wide, 128-token blocks),
# global batch 16, fp32, AdamW, no clipping, on both sides.
GPT_SHARDED = (
    "+recipe=gpt_text",
    "model.n_embd=256",
    "data.block_size=128",
    "global_batch_size=16",
    "grad_clip_norm=null",
    "optimizer.lr=3e-4",
    "eval_interval=null",
    "eval_batches=1",
    "logger=[]",
)


def run_plain_sharded(engine: str, steps: int) -> dict[str, float]:
    command = [venv_tool("torchrun"), "--standalone", "--nproc-per-node=2"]
    command += [str(REPO / "benchmarks" / "plain_sharded.py"), f"--engine={engine}"]
    command += [f"--steps={steps}", f"--warmup={WARMUP}", "--global-batch-size=16"]
    result = json.loads(run(command, thread_env(2)).strip().splitlines()[-1])
    return {STEP: result["sec_per_step"], SPS: 16 / result["sec_per_step"]}


def sharded_step_suite(steps: int) -> list[Config]:
    """runner's fsdp, zero2 and zero3 against the plain script of each (FSDP2's fully_shard
    per block; deepspeed.initialize), the same gpt, tokens and optimizer."""
    configs = []
    for engine in ("fsdp", "zero2", "zero3"):
        plain = f"torchrun + plain {'FSDP2' if engine == 'fsdp' else 'DeepSpeed ' + engine}"
        runner = (*GPT_SHARDED, f"parallelism={engine}")
        configs += [
            Config(plain, partial(run_plain_sharded, engine, steps), plain),
            Config(
                f"runner parallelism={engine}",
                partial(run_runner, *runner, nproc=2, steps=steps),
                plain,
            ),
        ]
    # runner's zero3 defaults hold no gathered copy from forward to backward, so each module
    # is gathered again in backward; with DeepSpeed's (prefetch 5e7, reuse distance 1e9) a
    # model this small stays gathered, as in the plain script.
    deepspeeds = (
        "parallelism.prefetch_bucket_size=50000000",
        "parallelism.max_reuse_distance=1000000000",
    )
    configs.append(
        Config(
            "runner parallelism=zero3, DeepSpeed's prefetch and reuse distance",
            partial(
                run_runner, *GPT_SHARDED, "parallelism=zero3", *deepspeeds, nproc=2, steps=steps
            ),
            "torchrun + plain DeepSpeed zero3",
        )
    )
    return configs


def startup_suite(_steps: int) -> list[Config]:
    """B2 alone, for both models: forked ranks (the default), spawned ranks (every rank
    imports torch itself, as before the fork server), and the launcher not prestarted."""

    def first_step(model: str, measure: Callable[..., tuple[float, float]], **kwargs: Any):
        return lambda: {FIRST: measure(model, 10, **kwargs)[1]}

    configs = []
    for model in ("mlp", "resnet18"):
        plain = f"torchrun + plain PyTorch DDP, {model}"
        spawn = ("start_method=spawn",)
        configs += [
            Config(plain, first_step(model, outside_plain), plain),
            Config(f"runner, {model}", first_step(model, outside_runner), plain),
            Config(
                f"runner start_method=spawn, {model}",
                first_step(model, outside_runner, extra=spawn),
                plain,
            ),
            Config(
                f"runner, launcher not prestarted, {model}",
                first_step(model, outside_runner, prestart=False),
                plain,
            ),
        ]
    return configs


READY = "s to ranks ready"
START_METHODS = {
    "command": "torch elastic, a command started with Popen (torchrun's way)",
    "spawn": "torch elastic start_method=spawn (a function entry point)",
    "forkserver": "torch elastic start_method=forkserver (a function entry point)",
    "fork": "torch elastic start_method=fork (a function entry point)",
    "runner": "runner's fork server (the command, forked)",
}


def start_methods_suite(_steps: int) -> list[Config]:
    """The fork server against torch elastic's own ways to start ranks: 2 ranks that only
    import torch, join a gloo group, build a DDP model and meet in one all-reduce
    (start_methods.py), timed from the launcher's start."""

    def measure(method: str) -> dict[str, float]:
        command = [sys.executable, str(REPO / "benchmarks" / "start_methods.py"), method, "2"]
        result = json.loads(run(command, thread_env(2)).strip().splitlines()[-1])
        return {READY: result["ready_s"], "wall s": result["wall_s"]}

    baseline = START_METHODS["command"]
    return [Config(name, partial(measure, m), baseline) for m, name in START_METHODS.items()]


SWEEP_JOBS, SWEEP_STEPS = 10, 20
SWEEP_WALL = "sweep wall s"


def sweep_suite(_steps: int) -> list[Config]:
    """A sweep of many short jobs, where start-up is most of the time: SWEEP_JOBS mlp runs of
    SWEEP_STEPS steps, one after another, as `runner -m` and as a shell loop of torchrun."""
    job = ["model=mlp", "data=synthetic", "nproc=2", "global_batch_size=64", "max_epochs=null"]
    job += [f"max_steps={SWEEP_STEPS}", "eval_interval=1000000", "progress_bar=false"]
    seeds = "seed=" + ",".join(str(i) for i in range(SWEEP_JOBS))

    def runner_sweep(*extra: str) -> Callable[[], dict[str, float]]:
        def measure() -> dict[str, float]:
            with tempfile.TemporaryDirectory() as tmp:
                command = [venv_tool("runner"), "-m", *job, seeds, *extra]
                wall, _, _ = time_command([*command, f"hydra.sweep.dir={tmp}/sweep"], tmp, 2)
            return {SWEEP_WALL: wall}

        return measure

    def plain_loop() -> dict[str, float]:
        args = ("--model=mlp", "--global-batch-size=64")
        start = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(SWEEP_JOBS):
                time_command(plain_command(*args, nproc=2, steps=SWEEP_STEPS, warmup=0), tmp, 2)
        return {SWEEP_WALL: time.time() - start}

    plain = f"{SWEEP_JOBS} x torchrun + plain PyTorch DDP"
    return [
        Config(plain, plain_loop),
        Config("runner -m, start_method=spawn", runner_sweep("start_method=spawn"), plain),
        Config("runner -m", runner_sweep(), plain),
    ]


PRUNED_STEPS, PRUNED_WALL = "trained steps", "sweep wall s"
BEST_TRIAL, BEST_VALUE = "best trial", "best val/accuracy"
PRUNING_TRIALS, PRUNING_STEPS, PRUNING_EVAL = 12, 1000, 100


def pruning_suite(_steps: int) -> list[Config]:
    """One search, with and without a pruner: PRUNING_TRIALS learning rates drawn by a seeded
    random sampler (the same ones whatever the trials report), one trial at a time, mlp on
    digits, PRUNING_STEPS steps each, an evaluation every PRUNING_EVAL. What the search
    trained (the steps of every trial) and which trial it found best."""
    search = [
        "hydra/sweeper=runner", "hydra/launcher=runner", "hydra/sweeper/sampler=random",
        "hydra.sweeper.sampler.seed=0", f"hydra.sweeper.n_trials={PRUNING_TRIALS}",
        "hydra.sweeper.n_jobs=1", "optimizer.lr=tag(log, interval(0.0001, 0.3))",
        "model=mlp", "data=digits", "precision=fp32", "nproc=1", "max_epochs=null",
        f"max_steps={PRUNING_STEPS}", f"eval_interval={PRUNING_EVAL}",
        f"log_interval={PRUNING_EVAL}",
        "progress_bar=false", "checkpoint.interval=null",
    ]  # fmt: skip

    def sweep(*pruner: str) -> Callable[[], dict[str, float]]:
        def measure() -> dict[str, float]:
            with tempfile.TemporaryDirectory() as tmp:
                command = [venv_tool("runner"), "-m", *search, *pruner]
                wall, _, _ = time_command([*command, f"hydra.sweep.dir={tmp}/sweep"], tmp, 1)
                root = Path(tmp) / "sweep"
                study = json.loads((root / "study.json").read_text())
                summaries = [root / str(t["number"]) / "summary.json" for t in study["trials"]]
                steps = sum(json.loads(path.read_text())["steps"] for path in summaries)
            best = max(
                (t for t in study["trials"] if t["state"] == "COMPLETE"), key=lambda t: t["value"]
            )
            return {
                PRUNED_STEPS: steps,
                PRUNED_WALL: wall,
                BEST_TRIAL: best["number"],
                BEST_VALUE: best["value"],
            }

        return measure

    median = ["hydra/sweeper/pruner=median", "hydra.sweeper.pruner.n_startup_trials=3"]
    median += [f"hydra.sweeper.pruner.n_warmup_steps={2 * PRUNING_EVAL}"]
    asha = ["hydra/sweeper/pruner=asha", f"hydra.sweeper.pruner.min_resource={PRUNING_EVAL}"]
    asha += ["hydra.sweeper.pruner.reduction_factor=3"]
    return [
        Config("no pruner", sweep()),
        Config(f"median (3 startup trials, {2 * PRUNING_EVAL} warmup steps)", sweep(*median)),
        Config(f"asha (min {PRUNING_EVAL} steps, reduction 3)", sweep(*asha)),
    ]


def sync_suite(steps: int) -> list[Config]:
    rows = [
        runner_row(
            f"runner sync_strategy={s}", (*RESNET, "grad_accum=4", f"sync_strategy={s}"), steps
        )
        for s in ("single_auto_sync", "multi_auto_sync", "forced_sync")
    ]
    return [plain_resnet(4, steps), *rows]


def scaling_suite(steps: int) -> list[Config]:
    """Samples/s at nproc 1 and 2 with one thread per rank: the second core's worth."""
    configs = []
    for nproc in (1, 2):
        measure = plain_resnet(1, steps, nproc, threads=1).measure
        plain = Config(f"plain PyTorch DDP nproc={nproc}", measure)
        configs.append(plain)
        configs.append(
            Config(
                f"runner nproc={nproc}",
                lambda n=nproc: run_runner(*RESNET, nproc=n, steps=steps, threads=1),
                baseline=plain.name,
            )
        )
    return configs


# A step bound by launching ops, not by their arithmetic: the 12-layer gpt, 32 wide, on one
# rank (issue 67's CPU goal: within 1.02 of the plain script).
LAUNCH_BOUND = {"n_layer": 12, "n_embd": 32, "n_head": 2, "block_size": 64}
LAUNCH_BATCH, LAUNCH_WARMUP = 8, 20


def launch_bound_suite(steps: int) -> list[Config]:
    """runner against nanoGPT's way (plain_gpt.py on the CPU, fp32, DDP of one rank), both
    timed over the steps after LAUNCH_WARMUP: the plain script by its own clock, runner by
    its records' time/step_s (with a user's defaults: its tracker, its loader)."""
    from suites_gpu import random_corpus

    steps = max(steps, LAUNCH_WARMUP + 100)
    corpus = random_corpus(400_000)
    plain_args = [f"--{k.replace('_', '-')}={v}" for k, v in LAUNCH_BOUND.items()]
    plain_args += ["--device=cpu", "--precision=fp32", f"--global-batch-size={LAUNCH_BATCH}"]

    def plain() -> dict[str, float]:
        command = plain_command(
            *plain_args, nproc=1, steps=steps, warmup=LAUNCH_WARMUP, script="plain_gpt.py"
        )
        seconds = json.loads(run(command, thread_env(1)).strip().splitlines()[-1])["sec_per_step"]
        return {STEP: seconds, SPS: LAUNCH_BATCH / seconds}

    def ours() -> dict[str, float]:
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / "run"
            command = [venv_tool("runner"), "model=gpt", "data=text", f"data.root={corpus}"]
            command += ["loss=causal_lm", "metrics=language_model", "precision=fp32"]
            command += [f"model.{k}={v}" for k, v in LAUNCH_BOUND.items() if k != "block_size"]
            command += [f"data.block_size={LAUNCH_BOUND['block_size']}", "nproc=1"]
            command += [f"global_batch_size={LAUNCH_BATCH}", f"max_steps={steps}"]
            command += ["max_epochs=null", f"log_interval={LAUNCH_WARMUP}", "eval_interval=100000"]
            command += ["progress_bar=false", f"hydra.run.dir={run_dir}"]
            run(command, thread_env(1), cwd=tmp)
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
        # the last record holds the final evaluation's pause only: its steps alone count
        seconds = statistics.fmean(r["time/step_s"] for r in records if r["step"] > LAUNCH_WARMUP)
        return {STEP: seconds, SPS: LAUNCH_BATCH / seconds}

    name = "plain gpt 12x32, nanoGPT's way (1 rank, CPU)"
    return [Config(name, plain, name), Config("runner gpt 12x32 (1 rank, CPU)", ours, name)]
