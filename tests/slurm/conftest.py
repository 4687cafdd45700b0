"""The real-SLURM suite (`make test-slurm`): a two-node cluster on this machine
(tests/slurm/cluster.sh), brought up once for the session and torn down after, also after a
failure. `make test` collects these tests and skips them; `make test-slurm` sets
RUNNER_SLURM_TESTS=1. Without root, network namespaces or the SLURM packages they are
skipped with the reason."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "sacct", "ip", "nsenter")


def pytest_collection_modifyitems(config, items) -> None:
    reason = None
    if os.environ.get("RUNNER_SLURM_TESTS") != "1":
        reason = "the real-SLURM suite runs with make test-slurm"
    elif os.geteuid() != 0:
        reason = "a SLURM cluster with network namespaces needs root"
    elif missing := [t for t in TOOLS if shutil.which(t) is None]:
        reason = f"not installed: {', '.join(missing)} (make test-slurm installs slurm-wlm, munge)"
    for item in items:
        if "tests/slurm/" not in str(item.path).replace("\\", "/"):
            continue
        item.add_marker(pytest.mark.slurm)
        item.add_marker(pytest.mark.slow)  # jobs and ranks: processes
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def slurm() -> Iterator[dict[str, str]]:
    """The cluster: the environment that reaches it (SLURM_CONF). Its state lives outside
    pytest's temporary directories, which only root may enter (munged and slurmctld run as
    their own users)."""
    state = Path(tempfile.mkdtemp(prefix="runner-slurm-"))
    state.chmod(0o755)
    script = str(HERE / "cluster.sh")
    up = subprocess.run([script, "up", str(state)], capture_output=True, text=True, timeout=120)
    try:
        if up.returncode != 0:
            pytest.fail(f"the SLURM cluster did not come up:\n{up.stdout}{up.stderr}")
        yield {**os.environ, "SLURM_CONF": str(state / "slurm.conf")}
    finally:
        subprocess.run([script, "down", str(state)], capture_output=True, timeout=60)
        shutil.rmtree(state, ignore_errors=True)


def _busy(env: dict[str, str]) -> list[str]:
    """What keeps the cluster from being as a test found it: jobs in the queue (completing
    ones too) and nodes that are not idle."""

    def ask(*command: str) -> list[str]:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=30)
        return done.stdout.split("\n") if done.returncode == 0 else [f"{command[0]} failed"]

    jobs = [f"job {line.strip()}" for line in ask("squeue", "-h", "-o", "%i %T") if line.strip()]
    nodes = [line.strip() for line in ask("sinfo", "-h", "-N", "-o", "%N %T") if line.strip()]
    return jobs + [f"node {n}" for n in nodes if not n.endswith(" idle")]


def _wait_quiet(env: dict[str, str], timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while (busy := _busy(env)) and time.monotonic() < deadline:
        time.sleep(1)
    return busy


@pytest.fixture(autouse=True)
def quiet_cluster(slurm: dict[str, str]) -> Iterator[None]:
    """Each test starts on an empty queue with both nodes idle, and leaves the cluster so: an
    earlier test's job (requeued, or still completing) held the two nodes, and the next
    test's job waited on them past its time limit. What a test leaves queued is cancelled."""
    busy = _wait_quiet(slurm, timeout=240)
    assert not busy, f"the cluster is still busy before this test: {busy}"
    yield
    if _busy(slurm):  # the tests run as root (network namespaces), and so do their jobs
        subprocess.run(["scancel", "--user=root"], env=slurm, capture_output=True, timeout=30)
    busy = _wait_quiet(slurm, timeout=120)
    assert not busy, f"the cluster is still busy after this test: {busy}"
