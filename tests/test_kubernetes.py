"""nodes=auto in a Kubernetes pod: the environment Kubeflow Trainer's TrainJob and the
training operator's PyTorchJob set in each pod."""

from __future__ import annotations

import pytest

from runner.spec import SpecError, resolve_spec
from runner.spec.kubernetes import placement
from tests.helpers.cli import HANG
from tests.helpers.config import compose_config

# What Kubeflow Trainer's torch plugin sets in pod 2 of a 3-node TrainJob (torchrun's PET_*)
TRAINJOB = {
    "PET_NNODES": "3",
    "PET_NPROC_PER_NODE": "8",
    "PET_NODE_RANK": "2",
    "PET_MASTER_ADDR": "llm-node-0-0.llm",
    "PET_MASTER_PORT": "29400",
}
# A PyTorchJob with nprocPerNode (training operator v1): PET_* beside the plain forms
PYTORCHJOB_ELASTIC = {
    "PET_NNODES": "1:4",
    "PET_NODE_RANK": "1",
    "PET_MASTER_ADDR": "job-master-0",
    "PET_MASTER_PORT": "23456",
    "MASTER_ADDR": "job-master-0",
    "MASTER_PORT": "23456",
    "WORLD_SIZE": "16",
    "RANK": "1",
}
# A PyTorchJob without it: one process per pod, WORLD_SIZE pods
PYTORCHJOB_PLAIN = {
    "MASTER_ADDR": "job-master-0",
    "MASTER_PORT": "23456",
    "WORLD_SIZE": "2",
    "RANK": "1",
}

NO_PORT = {k: v for k, v in PYTORCHJOB_PLAIN.items() if k != "MASTER_PORT"}


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        (TRAINJOB, (3, 2, "llm-node-0-0.llm", 29400)),
        (PYTORCHJOB_ELASTIC, (4, 1, "job-master-0", 23456)),
        (PYTORCHJOB_PLAIN, (2, 1, "job-master-0", 23456)),
        (NO_PORT, (2, 1, "job-master-0", 29500)),
    ],
    ids=["trainjob", "pytorchjob-nproc-per-node", "pytorchjob", "default port"],
)
def test_each_operators_variables(environ: dict[str, str], expected: tuple) -> None:
    place = placement(environ, master_port=None)
    assert place is not None
    assert (place.nodes, place.node_rank, place.master_addr, place.master_port) == expected
    assert placement(environ, master_port=1234).master_port == 1234  # a given port wins
    assert placement({"HOME": "/root", "RANK": "0"}, master_port=None) is None


def test_nodes_auto_in_a_pod_and_unreadable_variables() -> None:
    spec = resolve_spec(
        compose_config(["nodes=auto", "device=cpu", "nproc=2", "global_batch_size=60"]),
        environ=TRAINJOB,
    )
    assert (spec.nodes, spec.node_rank, spec.master_addr, spec.master_port) == (
        3,
        2,
        "llm-node-0-0.llm",
        29400,
    )
    assert spec.nproc == 2  # given: the job's 8 per node do not override it
    auto = compose_config(["nodes=auto", "device=cpu", "nproc=auto", "global_batch_size=48"])
    assert resolve_spec(auto, environ=TRAINJOB).nproc == 8  # the TrainJob's numProcPerNode
    for ask in ("auto", "gpu"):  # torchrun's words: runner's own choice (here: the cores)
        chosen = resolve_spec(auto, environ={**TRAINJOB, "PET_NPROC_PER_NODE": ask}).nproc
        assert chosen == resolve_spec(auto, environ={}).nproc
    for bad, message in (
        ({**TRAINJOB, "PET_NODE_RANK": "x"}, "PET_NODE_RANK='x' is not a whole number"),
        ({**TRAINJOB, "PET_NPROC_PER_NODE": "0"}, "PET_NPROC_PER_NODE=0: a node runs"),
        (  # 58fe533 started runner's own choice of ranks
            {**TRAINJOB, "PET_NPROC_PER_NODE": "two"},
            "PET_NPROC_PER_NODE='two' is neither a whole number nor one of auto, gpu, cpu",
        ),
        ({**TRAINJOB, "PET_NODE_RANK": "3"}, "PET_NODE_RANK=3 is not below PET_NNODES=3"),
        ({**TRAINJOB, "PET_MASTER_ADDR": ""}, "PET_MASTER_ADDR is not set"),
    ):
        expected = f"nodes=auto: cannot read the Kubeflow environment: {message}"
        with pytest.raises(SpecError, match=expected):
            resolve_spec(compose_config(["nodes=auto", "device=cpu"]), environ=bad)


def test_the_trainjob_is_valid_for_the_published_trainer_api() -> None:
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    from runner.cli.k8s_manifest import trainjob

    overrides = ["+recipe=gpt_text", "nodes=4", "nproc=8", "device=cuda", "master_port=1234"]
    spec = resolve_spec(compose_config([*overrides[:3], "master_port=1234"]), cuda_devices=8)
    job = trainjob(spec, overrides, "ghcr.io/me/runner:1", "LLM run #3", "torch-distributed")
    parsed = TrainerV1alpha1TrainJob.from_dict(job)
    assert parsed.to_dict() == job  # every field known to the API, none dropped
    trainer = parsed.spec.trainer
    assert (trainer.num_nodes, trainer.num_proc_per_node) == (4, 8)
    assert trainer.command == ["runner", "+recipe=gpt_text", "nproc=8", "device=cuda", "nodes=auto"]
    assert job["metadata"]["name"] == "llm-run-3"
    assert job["spec"]["trainer"]["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": "8"}}
    cpu = resolve_spec(compose_config(["nodes=2", "nproc=4", "device=cpu", "master_port=1"]))
    assert (
        "resourcesPerNode"
        not in trainjob(cpu, [], "img", "x", "torch-distributed")["spec"]["trainer"]
    )


@pytest.mark.slow
def test_k8s_manifest_prints_a_job_or_names_what_is_missing(tmp_path) -> None:
    import subprocess

    import yaml

    from tests.helpers.cli import child_env, runner_command

    def manifest(*args: str) -> subprocess.CompletedProcess:
        command = runner_command("k8s-manifest", *args)
        return subprocess.run(
            command, cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=HANG
        )

    typed = manifest("--image", "img:1", "device=cuda")  # as a user types it
    assert typed.returncode == 0, typed.stderr
    assert yaml.safe_load(typed.stdout)["spec"]["trainer"]["image"] == "img:1"
    unsaid = manifest("--image", "img:1")  # this machine's hardware says nothing of the pods'
    assert unsaid.returncode == 2 and "give device=cuda or device=cpu" in unsaid.stderr
    good = manifest("--image", "img:1", "--name", "demo", "nodes=2", "nproc=4", "device=cpu")
    assert good.returncode == 0, good.stderr
    job = yaml.safe_load(good.stdout)
    assert job["kind"] == "TrainJob" and job["metadata"]["name"] == "demo"
    assert job["spec"]["trainer"]["command"] == ["runner", "nproc=4", "device=cpu", "nodes=auto"]
    bad = manifest("--image", "img:1", "nodes=2", "nproc=auto", "device=cpu", "max_steps=0")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "nproc=auto: give the ranks per pod (nproc=N)" in bad.stderr
    assert manifest("nodes=2").returncode == 2
    assert not any(tmp_path.iterdir()), "a manifest writes no run directory"
