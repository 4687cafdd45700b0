"""`runner k8s-manifest --image IMAGE [--name NAME] [--runtime RUNTIME] [overrides]`: a
Kubeflow Trainer TrainJob for the run, printed as YAML for `kubectl apply -f -`.

The overrides are checked as for a run (exit 2 on bad input, nothing started). Each pod
runs `runner OVERRIDES nodes=auto`: runner reads the node count, its rank and the master
from the PET_* variables the torch runtime sets (runner.spec.kubernetes) and starts the
pod's `nproc` ranks itself, as on SLURM. `numNodes` is the run's `nodes`; under
device=cuda each pod asks for `nproc` GPUs.
"""

from __future__ import annotations

import atexit
import logging
import re
import shutil
import sys
import tempfile
import time
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf

from runner.secrets import Secrets
from runner.spec import RunSpec, SpecError, resolve_spec
from runner.spec.composed import problems_text

log = logging.getLogger("runner")
USAGE = "usage: runner k8s-manifest --image IMAGE [--name NAME] [--runtime NAME] [KEY=VALUE ...]"
API_VERSION = "trainer.kubeflow.org/v1alpha1"
PLACEMENT_KEYS = {"nodes", "node_rank", "master_addr", "master_port"}  # the pod's, from PET_*


class _Request:
    options: dict[str, str] = {}
    overrides: list[str] = []


def manifest_argv(args: list[str]) -> list[str]:
    """Hydra's arguments for `runner k8s-manifest ARGS`: the run's overrides, composed in a
    temporary directory nothing is written to."""
    options = {"--name": "", "--runtime": "torch-distributed", "--image": ""}
    rest, i = [], 0
    while i < len(args):
        flag, equals, value = args[i].partition("=")
        if flag in options:
            if not equals:
                i += 1
                value = args[i] if i < len(args) else ""
            options[flag] = value
        else:
            rest.append(args[i])
        i += 1
    if not options["--image"]:
        print(f"runner k8s-manifest: --image is required\n{USAGE}", file=sys.stderr)
        sys.exit(2)
    _Request.options, _Request.overrides = options, rest
    workdir = tempfile.mkdtemp(prefix="runner-k8s-")
    atexit.register(shutil.rmtree, workdir, True)
    return [*rest, f"hydra.run.dir={workdir}", "hydra.output_subdir=null"]


def manifest_task(cfg: DictConfig) -> None:
    """Hydra's task: check the config as for a run on the cluster's nodes, print the job."""
    options = _Request.options
    data = OmegaConf.to_container(cfg, resolve=True)
    problems = _placement_problems(data)
    secrets = Secrets.of(OmegaConf.to_container(cfg, resolve=False), data)
    problems += [
        f"{key}: a manifest would hold this secret; give it as '${{oc.env:NAME}}' and set NAME "
        "in the pod from a Kubernetes Secret"
        for key in secrets.values
    ]
    spec = None
    if not problems:
        data["master_port"] = data.get("master_port") or 29500  # each pod's from PET_*
        gpus = data.get("nproc") if data.get("device") == "cuda" else 0
        try:  # the pods' hardware, not this machine's: nproc GPUs under device=cuda
            spec = resolve_spec(data, cuda_devices=gpus if isinstance(gpus, int) else 0)
        except SpecError as err:
            problems = err.problems
    if problems or spec is None:
        log.error("%s", problems_text(problems))
        sys.exit(2)
    name = options["--name"] or f"runner-{time.strftime('%Y%m%d-%H%M%S')}"
    job = trainjob(spec, _Request.overrides, options["--image"], name, options["--runtime"])
    print(yaml.safe_dump(job, sort_keys=False), end="")


def _placement_problems(data: Any) -> list[str]:
    found = []
    if not isinstance(data.get("nodes"), int):
        found.append(f"nodes={data.get('nodes')}: give the number of pods (nodes=N)")
    if not isinstance(data.get("nproc"), int):
        found.append(f"nproc={data.get('nproc')}: give the ranks per pod (nproc=N)")
    if data.get("device") not in ("cpu", "cuda"):
        found.append(
            f"device={data.get('device')}: the pods' hardware is not this machine's; "
            "give device=cuda or device=cpu"
        )
    return found


def trainjob(spec: RunSpec, overrides: list[str], image: str, name: str, runtime: str) -> dict:
    """The TrainJob: `spec.nodes` pods of `image`, each running `runner OVERRIDES nodes=auto`."""
    kept = [o for o in overrides if o.partition("=")[0].lstrip("+~") not in PLACEMENT_KEYS]
    trainer: dict[str, Any] = {
        "image": image,
        "command": ["runner", *kept, "nodes=auto"],
        "numNodes": spec.nodes,
        "numProcPerNode": spec.nproc,
    }
    if spec.device == "cuda":
        trainer["resourcesPerNode"] = {"limits": {"nvidia.com/gpu": str(spec.nproc)}}
    return {
        "apiVersion": API_VERSION,
        "kind": "TrainJob",
        "metadata": {"name": _dns_name(name)},
        "spec": {"runtimeRef": {"name": runtime}, "trainer": trainer},
    }


def _dns_name(name: str) -> str:
    """A Kubernetes object name: lower case letters, digits and dashes, 63 at most."""
    cleaned = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
    return cleaned[:63].rstrip("-") or "runner"
