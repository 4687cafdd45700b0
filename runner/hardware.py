"""What this machine offers, probed cheaply: the parent must not import torch for nothing."""

from __future__ import annotations

import glob
import os
import platform
import shutil
import subprocess


def peak_rss_bytes() -> int:
    """The most resident memory this process has held (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    """The resident memory this process holds now (Linux; 0 where /proc is absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def library_rss_bytes() -> int:
    """The resident bytes of files this process maps (RssFile: its libraries' code and
    data, shared with every process that maps them, and given back by the kernel under
    pressure; Linux; 0 where /proc is absent). How much of a library a first call maps
    differs by kernel (some map a whole large folio of its pages at a fault): a rank's peak
    is measured above its base and the library pages it mapped since."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssFile:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_cores() -> int:
    """Cores this process may run on (respects taskset/cgroup affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cuda_device_count() -> int:
    """Visible CUDA devices. Imports torch only when an NVIDIA driver is present."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return 0
    if not (os.path.exists("/proc/driver/nvidia") or glob.glob("/dev/nvidia[0-9]*")):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def threads_per_rank(local_ranks: int, cores: int | None = None) -> int:
    """Intra-op threads for each of `local_ranks` ranks sharing this node's cores."""
    cores = cpu_cores() if cores is None else cores
    return max(1, cores // max(1, local_ranks))


def query_gpus(field: str) -> list[str] | None:
    """One nvidia-smi field of each GPU the driver sees (no torch); None without nvidia-smi
    or when it fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, f"--query-gpu={field}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.strip() for line in out.splitlines() if line.strip()]


def cuda_compute_capabilities() -> list[float]:
    """Compute capability of each visible GPU from nvidia-smi (no torch); [] if unknown."""
    try:
        return [float(value) for value in query_gpus("compute_cap") or []]
    except ValueError:
        return []


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU computes in bf16 natively (AVX512-BF16 or AMX-BF16, from /proc/cpuinfo).
    Without them bf16 autocast is emulated: a resnet18 step ran 15x slower than fp32 on
    an AVX2 machine here."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return False
    flags = set(cpuinfo.split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def auto_precision(device: str, capabilities: list[float], cpu_bf16: bool = False) -> str:
    """precision=auto: on GPUs bf16 with native bf16 (compute capability >= 8.0, Ampere and
    newer), fp16 with loss scaling on older or unknown ones; on CPU bf16 only where the CPU
    has native bf16 (`cpu_bf16`), else fp32."""
    if device != "cuda":
        return "bf16" if cpu_bf16 else "fp32"
    return "bf16" if capabilities and min(capabilities) >= 8.0 else "fp16"


FLOAT8_CAPABILITY = 8.9  # float8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.0)
FLOAT8_INSTALL = "pip install 'runner[float8]'"


def float8_problem(capabilities: list[float]) -> str | None:
    """Why precision=float8 cannot run on GPUs of these compute capabilities (None: it
    can, or they are unknown)."""
    if capabilities and min(capabilities) < FLOAT8_CAPABILITY:
        return (
            f"precision=float8: float8 matmuls need a GPU of compute capability "
            f"{FLOAT8_CAPABILITY} or newer (Ada, Hopper, Blackwell); this machine's is "
            f"{min(capabilities):g}; use precision=bf16"
        )
    return None


SHARED_MEMORY_DIR = "/dev/shm"


def shared_memory_obstacle(device: str, nodes: int, machine: str | None = None) -> str | None:
    """Why ranks cannot all-reduce through shared memory here (None when they can): they
    must share one machine's memory and CPU, an x86-64 one (runner.engines.shared_memory
    relies on its store order), with a /dev/shm to map."""
    machine = platform.machine() if machine is None else machine
    if not device.startswith("cpu"):
        return f"device={device} (its backend reduces device memory itself)"
    if nodes > 1:
        return f"nodes={nodes} (the ranks must share one machine)"
    if machine.lower() not in ("x86_64", "amd64"):
        return f"a {machine} CPU (only x86-64 keeps the order of stores it relies on)"
    if not os.path.isdir(SHARED_MEMORY_DIR):
        return f"no {SHARED_MEMORY_DIR} on this machine"
    return None


# Dense peak TFLOP/s of one GPU by the dtype its matmuls run in (vendors' data sheets, without
# sparsity). fp32 is the plain FP32 rate: runner leaves TF32 off. A row's name matches the
# device's (torch.cuda.get_device_name) when all its words are words of it; rows are tried
# in order, so the more specific come first.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "fp32": 80.0},
    "H200": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.2},
    "H100": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},  # SXM
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.1, "fp16": 362.1, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3},
    "A10": {"bf16": 125.0, "fp16": 125.0, "fp32": 31.2},
    "V100": {"fp16": 125.0, "fp32": 15.7},  # no bf16 in hardware
}


def gpu_row(name: str) -> str | None:
    """The PEAK_TFLOPS row for a GPU named `name` ('NVIDIA H100 80GB HBM3', 'A100'), or None."""
    words = set(name.replace("-", " ").replace("_", " ").upper().split())
    for row in PEAK_TFLOPS:
        if set(row.upper().split()) <= words:
            return row
    return None


def mfu_dtype(precision: str) -> str:
    """The peak MFU is taken against at `precision`: float8 training's against bf16's, as
    torchtitan reports it (only its converted layers' matmuls run in float8), so its MFU
    compares with a bf16 run's."""
    return "bf16" if precision == "float8" else precision


def peak_tflops(name: str, dtype: str) -> float | None:
    """One GPU's dense peak TFLOP/s at `dtype` (fp32, bf16, fp16); None when not in the table."""
    row = gpu_row(name)
    return None if row is None else PEAK_TFLOPS[row].get(dtype)
