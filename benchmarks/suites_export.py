"""`runner export`'s peak memory: a run's weights written as safetensors one tensor at a
time, against the script a user would write (torch.load the state_dict, save_file it)."""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import MB, machine, run, thread_env, venv_tool
from suites_memory import GPT_CAPACITY, gpt_parameters

EXPORT_LAYERS = 8
PLAIN = (
    "import sys, torch\n"
    "from safetensors.torch import save_file\n"
    "state = torch.load(sys.argv[1], map_location='cpu', weights_only=True)\n"
    "save_file({k: v.contiguous() for k, v in state.items()}, sys.argv[2])\n"
)
IMPORT_ONLY = "import torch, safetensors.torch"


def _peak_mb(command: list[str]) -> float:
    """The command's peak resident memory (GNU time's %M, KiB)."""
    proc = subprocess.run(
        ["/usr/bin/time", "-f", "%M", *command],
        capture_output=True,
        text=True,
        env=thread_env(1),
    )
    if proc.returncode != 0:
        sys.exit(f"export benchmark failed: {' '.join(command)}\n{proc.stderr[-2000:]}")
    return int(proc.stderr.strip().splitlines()[-1]) * 1024 / MB


def export_table(reps: int, _steps: int, _deadline: float | None = None) -> str:
    params = gpt_parameters(EXPORT_LAYERS)
    largest = 4 * 4 * 1024 * 1024 / MB  # a 4096 x 1024 fp32 matrix
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sources = {}
        for parallelism in ("ddp", "fsdp", "zero3"):
            run_dir = root / parallelism
            command = [venv_tool("runner"), *GPT_CAPACITY, f"model.n_layer={EXPORT_LAYERS}"]
            command += [f"parallelism={parallelism}", "nproc=2", "max_steps=1"]
            command += ["progress_bar=false", f"hydra.run.dir={run_dir}"]
            run(command, thread_env(2), cwd=tmp)
            (checkpoint,) = (run_dir / "checkpoints").glob("step_*")
            sources[f"{parallelism} checkpoint"] = checkpoint
        sources = {"model.pt (ddp run)": root / "ddp", **sources}
        floor = statistics.median(
            _peak_mb([sys.executable, "-c", IMPORT_ONLY]) for _ in range(reps)
        )
        plain = statistics.median(
            _peak_mb([sys.executable, "-c", PLAIN, str(root / "ddp" / "model.pt"), str(root / "p")])
            for _ in range(reps)
        )
        rows.append(("plain: torch.load + safetensors save_file, model.pt", plain))
        for label, source in sources.items():
            out = root / "out"
            peaks = [
                _peak_mb([venv_tool("runner"), "export", str(source), "--to", str(out)])
                for _ in range(reps)
            ]
            rows.append((f"runner export, {label}", statistics.median(peaks)))
    lines = [
        f"### runner export: peak memory, a gpt of {params / 1e6:.1f}M parameters "
        f"({4 * params / MB:.0f} MB in fp32; its largest tensor {largest:.0f} MB)",
        "",
        f"Machine: {machine()}. {reps} runs each, the median of the process's peak RSS (GNU "
        "time). The plain row is the script a user would write: torch.load the state_dict, "
        "safetensors' save_file. Above the import: the peak less that of a process that "
        f"only imports torch and safetensors ({floor:.0f} MB). DeepSpeed's checkpoints are "
        "merged by its zero_to_fp32, which reads every rank's partition files first.",
        "",
        "| source | peak RSS MB | above the import MB | x the model's fp32 size |",
        "|---|---|---|---|",
    ]
    for label, peak in rows:
        above = peak - floor
        lines.append(f"| {label} | {peak:.0f} | {above:.0f} | {above / (4 * params / MB):.2f} |")
    return "\n".join(lines) + "\n"
