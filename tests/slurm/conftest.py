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
