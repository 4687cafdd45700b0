"""The checks of what a run needs of the machines and packages around it (part of check_spec,
runner.spec.checks): its cluster (nodes, ports, Ray), its trackers' packages, the GPU a
model-FLOPs figure is read against."""

from __future__ import annotations

import importlib.util

from runner import hardware
from runner.spec.schema import RunSpec


def check_cluster(spec: RunSpec, problems: list[str]) -> None:
    if spec.launcher.name == "ray":
        check_ray(spec, problems)
        return
    if spec.node_rank >= spec.nodes:
        problems.append(
            f"node_rank={spec.node_rank}: must be in 0..{spec.nodes - 1} for nodes={spec.nodes}"
        )
    if spec.nodes > 1 and spec.master_port is None:
        problems.append(
            f"master_port=null: nodes={spec.nodes} needs a fixed port all nodes agree on"
        )
    if not spec.master_addr.strip():
        problems.append("master_addr='': must be a host name or IP address")


def check_ray(spec: RunSpec, problems: list[str]) -> None:
    """One runner drives a Ray run: Ray places its nodes x nproc workers."""
    if importlib.util.find_spec("ray") is None:
        problems.append(
            "launcher=ray: Ray is not installed here; pip install 'runner[ray]' "
            "(or launcher=elastic)"
        )
    if spec.node_rank != 0:
        problems.append(
            f"node_rank={spec.node_rank}: under launcher=ray one runner starts every worker; "
            "start it once, with node_rank=0"
        )


def check_trackers(spec: RunSpec, problems: list[str]) -> None:
    for name in spec.logger.selected:
        module, extra = LOGGER_PACKAGES.get(name, (None, None))
        if module and importlib.util.find_spec(module) is None:
            problems.append(
                f"logger={name}: needs the {module} package, which is not installed "
                f"(pip install 'runner[{extra}]')"
            )


def check_mfu(spec: RunSpec, problems: list[str]) -> None:
    gpu = spec.mfu.gpu
    if gpu is not None and spec.mfu.peak_tflops is None:
        row = hardware.gpu_row(gpu)
        if row is None:
            problems.append(
                f"mfu.gpu={gpu!r}: not a GPU runner knows the peak of; known: "
                f"{', '.join(hardware.PEAK_TFLOPS)} (or set mfu.peak_tflops)"
            )
        elif hardware.mfu_dtype(spec.precision.name.value) not in hardware.PEAK_TFLOPS[row]:
            problems.append(
                f"mfu.gpu={gpu!r}: {row} has no {spec.precision.name.value} peak in runner's "
                f"table; set mfu.peak_tflops"
            )


LOGGER_PACKAGES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "mlflow": ("mlflow", "mlflow"),
    "wandb": ("wandb", "wandb"),
}
