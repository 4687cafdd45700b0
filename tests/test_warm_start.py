"""The warm server (runner.launch.warm_server): an agent forked from it trains what a new
interpreter's does, a request it cannot serve gets a new interpreter, and a command that
dies leaves its warm agent a SIGTERM, as a new interpreter's gets from the kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from runner.launch.warm_server import mismatch
from runner.processes import WARM_SERVER_ENV as SERVER_ENV
from tests.helpers import warm
from tests.helpers.cli import FAST, HANG, RESTARTABLE, child_env, runner_command
from tests.helpers.weights import same_weights

# This module picks, run by run, whether the command may use the suite's warm server.
COLD_START = True


def cache_dir() -> str:
    """TORCHINDUCTOR_CACHE_DIR as torch's compiler sets it when it loads without one."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(default_cache_dir())


def _forked_cpu(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.children_user + times.children_system


def _run(tmp_path: Path, name: str, env: dict[str, str], *overrides: str):
    return subprocess.run(
        runner_command(*RESTARTABLE, *overrides, f"hydra.run.dir={tmp_path / name}"),
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG,
    )  # fmt: skip


@pytest.mark.slow
def test_a_warm_agent_trains_what_a_new_interpreters_agent_does(tmp_path, capsys):
    """The same weights and losses from a warm agent as from a new interpreter's (the command
    named a server that is gone: it starts one, says so once, and trains). A command from a
    process that imported torch's compiler (which sets TORCHINDUCTOR_CACHE_DIR as it loads)
    is served warm; one whose environment differs in what a library reads at load is not."""
    from runner.cli import warm_start

    socket_path = warm.start()
    server = warm.server_pid()
    assert server is not None
    gone = {**child_env(), SERVER_ENV: str(tmp_path / "nobody.sock")}
    cold = _run(tmp_path, "cold", gone)
    assert cold.returncode == 0, cold.stderr
    said = [line for line in cold.stderr.splitlines() if line.startswith(warm_start.FALLBACK)]
    assert len(said) == 1 and "no warm server at" in said[0], cold.stderr
    before = _forked_cpu(server)
    compiler = {"TORCHINDUCTOR_CACHE_DIR": cache_dir()}  # as torch's compiler leaves it
    hot = _run(tmp_path, "warm", {**child_env(), SERVER_ENV: socket_path, **compiler})
    assert hot.returncode == 0, hot.stderr
    assert "Warning" not in hot.stderr, hot.stderr  # what a fork adds: nothing on the console
    assert warm_start.FALLBACK not in hot.stderr, hot.stderr
    assert _forked_cpu(server) > before + 0.2  # its agent and ranks ran below the server
    finals = [json.loads((tmp_path / n / "summary.json").read_text()) for n in ("cold", "warm")]
    losses = [{k: v for k, v in f["final"].items() if "loss" in k} for f in finals]
    assert losses[0] == losses[1] and losses[0]
    assert same_weights(tmp_path / "cold", tmp_path / "warm")
    # another environment where a library reads it as it loads: refused, and said (the
    # command then starts a new interpreter, as the cold run above did)
    assert mismatch({**child_env(), "OMP_NUM_THREADS": "2"}, child_env()) == "OMP_NUM_THREADS"
    other = {**child_env(), SERVER_ENV: socket_path, "OMP_NUM_THREADS": "2"}
    assert warm_start.start("runner.launch.agent", ["-"], other, pipes=1) is None
    assert "OMP_NUM_THREADS differs from the server's environment" in capsys.readouterr().err


def test_a_value_a_library_sets_as_it_loads_is_the_servers_too() -> None:
    own = {"OMP_NUM_THREADS": "1", "PATH": "/bin"}
    loaded = {**own, "TORCHINDUCTOR_CACHE_DIR": "/tmp/torchinductor_me"}
    assert mismatch(own, own, loaded) is None  # as the server's imports saw it
    assert mismatch(loaded, own, loaded) is None  # as they left it
    other_dir = {**own, "TORCHINDUCTOR_CACHE_DIR": "/elsewhere"}
    assert mismatch(other_dir, own, loaded) == "TORCHINDUCTOR_CACHE_DIR"
    assert mismatch({**own, "PATH": "/usr/bin"}, own, loaded) is None  # not read at load
    assert mismatch({"PATH": "/bin"}, own, loaded) == "OMP_NUM_THREADS"
    # a sweep's job on its GPUs: read as CUDA initializes, which the server never does
    assert mismatch({**own, "CUDA_VISIBLE_DEVICES": "1"}, own, loaded) is None
    assert mismatch({**own, "CUDA_HOME": "/opt/cuda"}, own, loaded) == "CUDA_HOME"
    # scikit-learn's setting for Intel's OpenMP, which the server did not load
    intel = {**own, "KMP_DUPLICATE_LIB_OK": "True"}
    assert mismatch(intel, own, loaded) == "KMP_DUPLICATE_LIB_OK"
    assert mismatch(intel, own, loaded, unread=("KMP_",)) is None


@pytest.mark.slow
def test_a_command_killed_leaves_its_warm_agent_a_sigterm_and_the_run_resumes(tmp_path):
    socket_path = warm.start()
    server = warm.server_pid()
    env = {**child_env(), SERVER_ENV: socket_path}
    run_dir = tmp_path / "run"
    overrides = [*FAST, "max_epochs=null", "max_steps=400", "log_interval=1",
                 "checkpoint.interval=5", f"hydra.run.dir={run_dir}"]  # fmt: skip
    command = subprocess.Popen(
        runner_command(*overrides), cwd=tmp_path, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + HANG
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 8):
        assert command.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    agents = [p for p in psutil.Process(server).children() if p.status() != psutil.STATUS_ZOMBIE]
    assert agents, "the agent is not the warm server's"
    command.kill()
    command.wait()
    psutil.wait_procs(agents, timeout=HANG)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert not [p for p in psutil.Process(server).children(recursive=True) if p.is_running()]
    resumed = subprocess.run(
        runner_command(*overrides[:-1], "max_steps=30", f"hydra.run.dir={run_dir}", "resume=auto"),
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    assert os.path.exists(run_dir / "model.pt")


@pytest.mark.slow
def test_a_second_server_at_a_listening_path_is_refused() -> None:
    """It would have taken the path from the first, which would have gone on unreachable
    (and taken the path from the second as it stopped)."""
    path = warm.start()
    argv = [sys.executable, "-m", "runner.launch.warm_server", path]
    second = subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=HANG)
    assert second.returncode == 2
    said = f"another one listens at {path}; stop it first, or give this one another path"
    assert second.stderr == f"runner warm server: {said}\n"
    assert os.path.exists(path) and warm.server_pid() is not None


@pytest.mark.slow
def test_a_warm_server_stopped_mid_run_ends_its_command_as_a_sigterm_does(tmp_path):
    """The server's forks get a SIGTERM when it ends: its command says why, exits 143 (the
    shell's code for SIGTERM, as any interrupted run's), and the run is resumable."""
    socket_path = str(tmp_path / "own.sock")
    env = {**child_env(), "RUNNER_WARM_SERVER_PARENT": str(os.getpid())}
    server = subprocess.Popen([sys.executable, "-m", "runner.launch.warm_server", socket_path],
                              env=env)  # fmt: skip
    try:
        deadline = time.monotonic() + HANG
        while not os.path.exists(socket_path):
            assert server.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        run_dir = tmp_path / "run"
        command = subprocess.Popen(
            runner_command(*FAST, "max_epochs=null", "max_steps=400", "log_interval=1",
                           "checkpoint.interval=5", f"hydra.run.dir={run_dir}"),
            cwd=tmp_path, env={**child_env(), SERVER_ENV: socket_path},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 8):
            assert command.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        server.terminate()
        _, stderr = command.communicate(timeout=HANG)
    finally:
        server.kill()
        server.wait()
    assert command.returncode == 143, stderr  # was 241: sys.exit(-15)
    assert "runner: the warm server ended; runner.launch.agent" in stderr, stderr
    assert "Traceback" not in stderr, stderr
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"


@pytest.mark.slow
def test_a_warm_fork_runs_on_the_commands_cores(tmp_path):
    """A command pinned to some cores (a sweep's job in its slot: hydra/launcher=runner) gets
    a warm process pinned to them, as a new interpreter would inherit them; it has what a
    CPU host's ranks import already (DeepSpeed among it)."""
    from runner.cli import warm_start
    from runner.processes import EXTENSIONS_ENV

    env = {**child_env(), SERVER_ENV: warm.start()}
    env[EXTENSIONS_ENV] = os.path.join(sys.prefix, "torch_extensions")  # as `runner` sets it
    out = tmp_path / "probe.json"
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(mine)})
    try:
        probe = warm_start.start("tests.helpers.forked_probe", [str(out)], env)
    finally:
        os.sched_setaffinity(0, mine)
    assert probe is not None and probe.wait(timeout=HANG) == 0
    forked = json.loads(out.read_text())
    assert forked["affinity"] == [min(mine)]
    # on a host without a GPU the server imported DeepSpeed for every ZeRO run's ranks
    import torch

    assert forked["deepspeed_loaded"] == (not torch.cuda.is_available())
