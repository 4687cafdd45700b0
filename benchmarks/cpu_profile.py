"""`make profile`: where a run's time goes, runner against the plain PyTorch script.

Samples every process of one run with py-spy (`record --subprocesses`, idle threads
not sampled) and sorts each sample by what the stack is doing, in every process
role: the `runner` parent, its launcher (or torchrun), and the ranks (summed). The
table is in busy seconds (samples / rate): work, not waiting on a socket or a
child, though on a loaded machine a thread waiting for a core counts as busy.
Writes benchmarks/results/profile_<model>.md and prints it.
"""

from __future__ import annotations

import argparse
import ast
import collections
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from harness import RESULTS, machine, plain_command, run, thread_env  # noqa: E402

PLAIN = REPO / "benchmarks" / "plain_ddp.py"
RUNNER_PACKAGE = str(REPO / "runner") + os.sep
FRAME = re.compile(r"^(?P<function>.*) \((?P<file>.*):(?P<line>\d+)\)$")


def _plain_loop_lines() -> range:
    """Lines of the plain script's training loop (its `while` in main)."""
    tree = ast.parse(PLAIN.read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    loop = next(n for n in ast.walk(main) if isinstance(n, ast.While))
    return range(loop.lineno, (loop.end_lineno or loop.lineno) + 1)


LOOP_LINES = _plain_loop_lines()


def _own(file: str) -> bool:
    return file.startswith(RUNNER_PACKAGE) or file == str(PLAIN)


def _in_training_loop(frames: list[tuple[str, str, int]]) -> bool:
    for function, file, line in frames:
        if function == "Trainer.fit" and file.startswith(RUNNER_PACKAGE):
            return True
        if function == "main" and file == str(PLAIN) and line in LOOP_LINES:
            return True
    return False


def category(frames: list[tuple[str, str, int]]) -> str:
    """What one rank sample is doing. `frames`: outermost first."""
    functions = {f for f, _, _ in frames}
    if "_find_and_load" in functions:
        if "DistributedDataParallel.__init__" in functions:
            return "setup: import torch._dynamo (in DDP's constructor)"
        return "setup: imports"
    if "Trainer.evaluate" in functions:
        return "evaluation"
    if "Trainer._finish" in functions or any(f.endswith("checkpointing.py") for _, f, _ in frames):
        return "checkpoint, weights and summary"
    if not _in_training_loop(frames):
        return "setup: process group, data, model, DDP, optimizer"
    if any(f.endswith("dataloader.py") for _, f, _ in frames):
        return "training loop: data loading"
    deepest = max(i for i, (_, file, _) in enumerate(frames) if _own(file))
    callee = frames[deepest + 1][1] if deepest + 1 < len(frames) else ""
    if os.sep + "torch" + os.sep in callee:
        return "training loop: torch (forward, backward, all-reduce, optimizer)"
    return "training loop: its own lines (Python, tensor ops called from them)"


# Process roles by depth in the tree py-spy follows (its own child at depth 0); the
# command lines it reports can be empty for a process it caught starting.
ROLES = {
    "runner": ("runner parent (Hydra, no torch)", "launcher", "ranks"),
    "plain": ("launcher", "ranks"),
}


def parent_category(frames: list[tuple[str, str, int]]) -> str:
    functions = {f for f, _, _ in frames}
    return "imports" if "_find_and_load" in functions else "other"


def tally(raw: Path, rate: int, roles: tuple[str, ...]) -> dict[str, collections.Counter[str]]:
    """Busy seconds per role and category from py-spy's raw (collapsed stack) output."""
    seconds: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for text in raw.read_text().splitlines():
        stack, count = text.rsplit(" ", 1)
        parts = stack.split(";")
        processes = [p for p in parts if p.startswith("process ")]
        frames = []
        for part in parts:
            match = FRAME.match(part)
            if match and not part.startswith("process "):
                frames.append((match["function"], match["file"], int(match["line"])))
        who = roles[min(len(processes), len(roles)) - 1]
        kind = category(frames) if who == "ranks" else parent_category(frames)
        seconds[who][kind] += int(count) / rate
    return seconds


def record(command: list[str], rate: int, out: Path, env: dict[str, str], cwd: str) -> None:
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or "py-spy"
    options = ["--subprocesses", "--nonblocking", "--full-filenames", "--format", "raw"]
    options += ["--rate", str(rate), "--output", str(out)]
    run([spy, "record", *options, "--", *command], env, cwd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="mlp", choices=["mlp", "resnet18"])
    parser.add_argument("--steps", type=int, default=None, help="default: mlp 500, resnet18 40")
    parser.add_argument("--rate", type=int, default=100, help="samples per second")
    parser.add_argument("--keep", type=Path, help="also keep py-spy's raw stacks in this folder")
    args = parser.parse_args()
    steps = args.steps or {"mlp": 500, "resnet18": 40}[args.model]
    nproc = 2
    env = thread_env(nproc)
    columns: dict[str, dict[str, collections.Counter[str]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        runner = [str(Path(sys.executable).parent / "runner"), f"model={args.model}"]
        runner += ["data=synthetic", f"nproc={nproc}", "global_batch_size=64", "max_epochs=null"]
        runner += [f"max_steps={steps}", "eval_interval=1000000", "progress_bar=false"]
        runner += [f"hydra.run.dir={tmp}/run"]
        plain = plain_command(
            f"--model={args.model}", "--global-batch-size=64", nproc=nproc, steps=steps, warmup=0
        )
        for name, command in (("runner", runner), ("plain", plain)):
            print(f"profiling {name} ...", file=sys.stderr, flush=True)
            out = Path(tmp) / f"{name}.txt"
            record(command, args.rate, out, env, tmp)
            columns[name] = tally(out, args.rate, ROLES[name])
            if args.keep:
                args.keep.mkdir(parents=True, exist_ok=True)
                shutil.copy(out, args.keep / f"{name}_{args.model}.txt")

    rows = sorted({(who, kind) for c in columns.values() for who in c for kind in c[who]})
    lines = [
        f"### Profile: {args.model}, synthetic 3x32x32, nproc={nproc}, global batch 64, "
        f"{steps} steps (evaluation once, at the end)",
        "",
        f"Machine: {machine()}. py-spy {args.rate} Hz over every process, idle threads not "
        "sampled; seconds busy (includes waiting for a core), ranks summed.",
        "",
        "| process | what | runner s | plain PyTorch s |",
        "|---|---|---|---|",
    ]
    for who, kind in rows:
        cells = [f"{columns[n].get(who, {}).get(kind, 0.0):.2f}" for n in ("runner", "plain")]
        lines.append(f"| {who} | {kind} | {cells[0]} | {cells[1]} |")
    totals = [sum(sum(c.values()) for c in columns[n].values()) for n in ("runner", "plain")]
    lines.append(f"| all | total | {totals[0]:.2f} | {totals[1]:.2f} |")
    table = "\n".join(lines) + "\n"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"profile_{args.model}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
