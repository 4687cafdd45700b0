"""MLflow and W&B with the real parts: a real `mlflow server` (or MLflow's local SQLite
store) read back with MlflowClient, and W&B's offline run files read back with its own
record protobufs (tests/helpers/wandb_records.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.cli import HANG, RESTARTABLE, child_env
from tests.helpers.wandb_records import history, records, summary

# Found, not imported: MLflow and W&B cost seconds to import, and every worker of the suite
# collects this module; the tests import what they read with.
for _tracker in ("mlflow", "wandb"):
    if importlib.util.find_spec(_tracker) is None:
        pytest.skip(f"{_tracker} is not installed", allow_module_level=True)


def MlflowClient(uri: str):  # noqa: N802 (MLflow's class, imported when a test reads)
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


pytestmark = pytest.mark.slow
KILL_AT_6 = ["chaos.kill_rank=1", "chaos.at_step=6", "chaos.action=raise"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def mlflow_server(tmp_path: Path) -> Iterator[str]:
    """`mlflow server` on 127.0.0.1: SQLite backend store, local artifact destination. Up
    once its own health endpoint answers (a free port can be taken by another test's
    process before the server binds it: then again on another port)."""
    store = tmp_path / "server"
    store.mkdir()
    for _ in range(3):
        server, uri = _start_mlflow_server(store)
        try:
            if _wait_until_serving(server, uri, store):
                yield uri
                return
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait(10)
    pytest.fail("mlflow server found its port taken three times")


def _start_mlflow_server(store: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**child_env(), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    command = [sys.executable, "-m", "mlflow", "server", "--workers", "1"]
    command += ["--backend-store-uri", f"sqlite:///{store / 'mlflow.db'}"]
    command += ["--artifacts-destination", str(store / "artifacts")]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(
        command,
        cwd=store,
        env=env,
        stdout=open(store / "server.log", "w"),  # noqa: SIM115
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return server, f"http://127.0.0.1:{port}"


def _wait_until_serving(server: subprocess.Popen, uri: str, store: Path) -> bool:
    """True once `server` answers at `uri`; False if it gave up its port to another."""
    import urllib.request

    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no proxy for it
    deadline = time.monotonic() + HANG
    while True:
        log = (store / "server.log").read_text()
        if server.poll() is not None or "address already in use" in log:
            assert "address already in use" in log, log[-3000:]
            return False
        try:
            with direct.open(f"{uri}/health", timeout=2) as answer:
                if answer.status == 200:
                    return True
        except OSError:
            pass
        assert time.monotonic() < deadline, "mlflow server did not start in 90 s"
        time.sleep(0.3)


def mlflow_run_id(run_dir: Path) -> str:
    return json.loads((run_dir / "tracker_runs.json").read_text())["mlflow"]["run_id"]


def metric_steps(client: Any, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def jsonl_values(run_dir: Path, key: str) -> list[tuple[int, float]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r[key]) for r in map(json.loads, lines) if key in r]


def assert_mlflow_holds_the_run(client: Any, run_dir: Path, run_id: str) -> None:
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["runner.status"] == "completed"
    assert run.data.params["optimizer.lr"] == "0.001"
    assert run.data.params["parallelism.name"] == "ddp"
    for key in ("train/loss", "val/accuracy", "lr"):  # every step once, the values exact
        assert metric_steps(client, run_id, key) == jsonl_values(run_dir, key), key
    done = json.loads((run_dir / "summary.json").read_text())
    assert run.data.metrics["summary/steps"] == done["steps"] == 12
    assert run.data.metrics["summary/wall_time_s"] == pytest.approx(done["wall_time_s"])
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"model.pt", "config.yaml", "summary.json"} <= artifacts


def test_mlflow_server_gets_params_metrics_status_and_artifacts_across_a_restart(
    cli, mlflow_server: str
) -> None:
    """Rank 1 fails at step 6; the elastic restart resumes from step 4 in the same MLflow run,
    and steps 5-6, logged before the failure, are not logged twice."""
    result = cli(
        *RESTARTABLE,
        "logger=[mlflow]",
        f"logger.mlflow.tracking_uri={mlflow_server}",
        "logger.mlflow.experiment_name=drill",
        "+logger.mlflow.tags.team=vision",
        "max_restarts=1",
        *KILL_AT_6,
    )
    assert result.returncode == 0, result.output
    client = MlflowClient(mlflow_server)
    experiment = client.get_experiment_by_name("drill")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == mlflow_run_id(result.run_dir)
    assert run.data.tags["team"] == "vision"
    assert run.info.run_name == result.run_dir.name
    assert_mlflow_holds_the_run(client, result.run_dir, run.info.run_id)
    model = client.download_artifacts(run.info.run_id, "model.pt", str(result.run_dir.parent))
    assert Path(model).read_bytes() == (result.run_dir / "model.pt").read_bytes()


def test_mlflow_default_store_failed_then_resumed_is_one_run(cli, tmp_path: Path) -> None:
    """MLflow's local SQLite store under runs/; a failed run is FAILED with its error, and
    resume=auto in the same directory goes on in the same MLflow run, no step twice."""
    failed = cli(*RESTARTABLE, "logger=[mlflow]", *KILL_AT_6)
    assert failed.returncode != 0
    store = tmp_path / "runs" / "mlflow.db"
    assert store.is_file()
    client = MlflowClient(f"sqlite:///{store}")
    run_id = mlflow_run_id(failed.run_dir)
    run = client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert "rank 1" in run.data.tags["runner.error"]
    assert "model.pt" not in {a.path for a in client.list_artifacts(run_id)}

    resumed = cli(*RESTARTABLE, "logger=[mlflow]", "resume=auto")
    assert resumed.returncode == 0, resumed.output
    assert mlflow_run_id(resumed.run_dir) == run_id
    (only,) = client.search_runs([run.info.experiment_id])
    assert only.info.run_id == run_id
    assert_mlflow_holds_the_run(client, resumed.run_dir, run_id)
    assert (tmp_path / "runs" / "mlartifacts").is_dir()


def open_store(uri: str) -> str:
    from runner.trackers.mlflow_runs import mlflow_client

    try:
        mlflow_client(uri).search_experiments()
        return "ok"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def test_parallel_jobs_open_a_new_local_store_one_at_a_time(tmp_path: Path) -> None:
    """Opening a SQLite store creates its tables; three processes at once left it
    half-migrated (`table _alembic_tmp_latest_metrics already exists`) before the lock.
    (New interpreters, not forks of multiprocessing's fork server: that server is shared by
    every test of the process, and one that imported MLflow broke test_zero_fp16's check
    that a DeepSpeed rank runs without it.)"""
    import multiprocessing

    uri = f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        assert pool.map(open_store, [uri] * 3) == ["ok"] * 3


def wandb_logs(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))


def test_wandb_offline_history_config_summary_and_a_resumed_run(cli) -> None:
    """Read back with wandb's record protobufs: every metrics record at its step; a run that
    failed on rank 0 says so in its summary, and resumed in its directory it keeps its W&B
    run id (a second offline log of the same run) and logs no step twice. The resumed run
    also selects an MLflow server that cannot be reached: a warning, and W&B and
    metrics.jsonl get everything."""
    rank0_fails = ["chaos.kill_rank=0", "chaos.at_step=6", "chaos.action=raise"]
    failed = cli(*RESTARTABLE, "logger=[wandb]", "+logger.wandb.tags=[drill]", *rank0_fails)
    assert failed.returncode != 0
    # resumed, with an MLflow server that cannot be reached beside it: a warning, no more
    unreachable = f"logger.mlflow.tracking_uri=http://127.0.0.1:{free_port()}"
    resumed = cli(*RESTARTABLE, "logger=[wandb,mlflow]", unreachable, "resume=auto")
    assert resumed.returncode == 0, resumed.output
    assert "warning: logger mlflow failed on rank 0" in resumed.stderr
    first, second = wandb_logs(resumed.run_dir)
    run_id = json.loads((resumed.run_dir / "tracker_runs.json").read_text())["wandb"]["id"]
    assert first.name == second.name == f"run-{run_id}.wandb"

    rows = history(first) + history(second)
    steps = [row["_step"] for row in rows]
    assert steps == sorted(set(steps)), "a step was logged twice"
    logged = [(row["_step"], row["train/loss"]) for row in rows if "train/loss" in row]
    assert logged == jsonl_values(resumed.run_dir, "train/loss")
    assert summary(first)["status"] == "failed"
    assert "ChaosError: chaos: rank 0 raised at step 6" in summary(first)["error"]
    done = summary(second)
    assert done["status"] == "completed" and done["steps"] == 12
    kinds = [r.WhichOneof("record_type") for r in records(second)]
    assert "artifact" in kinds and kinds[-1] == "exit"
    config = {
        item.key: json.loads(item.value_json)
        for r in records(second)
        if r.WhichOneof("record_type") == "run"
        for item in r.run.config.update
    }
    assert config["optimizer"]["lr"] == 0.001
    run = next(r.run for r in records(first) if r.WhichOneof("record_type") == "run")
    assert list(run.tags) == ["drill"] and run.project == "runner"
