"""hydra/launcher=runner: a sweep's jobs side by side on one node, each in its own slot of
devices (declared GPU ids recorded even without a GPU, else this machine's cores), a failed
job reported as it ends, fail_fast, and bad input refused before the first job."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runner.sweeps.job import as_first_node_found_it
from runner.sweeps.progress import SweepProgress
from runner.sweeps.resume import KEEP, NEW, RESUME, earlier_job, earlier_start
from runner.sweeps.slots import (
    CPU,
    GPU,
    DevicePool,
    Slots,
    cores_for,
    declared_devices,
    device_pool,
    device_problems,
    pool_problems,
    slot_size,
)
from tests.helpers.cli import FAST, HANG, child_env, run_sweep

LAUNCHER = "hydra/launcher=runner"
TINY = [*FAST, "max_epochs=null", "max_steps=4", "log_interval=2", "eval_interval=1000"]


def sweep(tmp_path: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, Path]:
    return run_sweep(tmp_path, LAUNCHER, *overrides, timeout=HANG)


def test_slots_are_taken_lowest_first_and_wait_while_short() -> None:
    slots = Slots(DevicePool(GPU, ("0", "1", "2", "3"), True))
    assert slots.take(2) == ("0", "1") and slots.take(2) == ("2", "3")
    assert slots.take(1) is None  # every device busy: the job waits
    slots.give_back(("2", "3"))
    slots.give_back(("0", "1"))
    assert slots.free == ["0", "1", "2", "3"]
    assert slot_size("auto", DevicePool(CPU, ("0", "1"), False)) == 2
    assert slot_size(1, DevicePool(CPU, ("0", "1"), False)) == 1
    assert slot_size("two", DevicePool(CPU, ("0", "1"), False)) == 1  # the job refuses it


def test_bad_slots_are_named() -> None:
    twice = pool_problems(DevicePool(GPU, ("0", "1", "1"), True), [1])
    assert twice == [
        "hydra.launcher.devices=['0', '1', '1']: 1 named twice; each device can be in one "
        "job's slot at a time"
    ]
    (short,) = pool_problems(DevicePool(GPU, ("0", "1"), True), [1, 4])
    assert short.startswith("nproc=4: a job takes a GPU per rank, and this node has 2 GPU(s)")
    assert short.endswith("use nproc<=2")
    (cores,) = pool_problems(DevicePool(CPU, ("0", "1"), False), [3])
    assert "a core per rank" in cores and "hydra.launcher.devices=[...]" in cores


def test_declared_gpus_on_a_host_without_them_share_its_cores() -> None:
    """Jobs side by side on declared GPUs of a CPU-only host train on its cores: each slot
    gets its part of them (58fe533: two jobs ran 2 threads each on 2 cores)."""
    pool = DevicePool(GPU, ("0", "1"), True)
    assert cores_for(pool, ("0",), [0, 1]) == {0} and cores_for(pool, ("1",), [0, 1]) == {1}
    four = DevicePool(GPU, ("0", "1", "2", "3"), True)
    assert cores_for(four, ("2", "3"), list(range(8))) == {4, 5, 6, 7}
    assert cores_for(four, ("3",), [0, 1]) == {1}  # more devices than cores: they share


def test_overrides_are_shown_as_typed() -> None:
    """Hydra's sweepers write parsed values back in Python's words (58fe533 echoed
    `progress_bar=False` in its lines and tables)."""
    from runner.sweeps.job_dirs import shown

    typed = ["progress_bar=False", "compile=True", "resume=None", "name=False_start", "x=1"]
    assert shown(typed) == "progress_bar=false compile=true resume=null name=False_start x=1"


def test_jobs_joblib_runs_side_by_side_draw_no_bar(monkeypatch) -> None:
    """Through the environment the ranks inherit: the job's config stays as composed."""
    from omegaconf import OmegaConf

    from runner.processes import NO_BAR_ENV
    from runner.sweeps.job import quiet_beside_others

    joblib = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
    basic = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"
    for target, n_jobs, bar in ((joblib, 2, False), (joblib, 1, True), (basic, None, True)):
        monkeypatch.delenv(NO_BAR_ENV, raising=False)
        cfg = OmegaConf.create({"progress_bar": True})
        hydra_cfg = OmegaConf.create({"launcher": {"_target_": target, "n_jobs": n_jobs}})
        quiet_beside_others(cfg, hydra_cfg)
        assert cfg == OmegaConf.create({"progress_bar": True}), target
        assert (NO_BAR_ENV not in os.environ) is bar, target


def test_devices_are_gpu_indices_or_uuids() -> None:
    """`abc` reached CUDA_VISIBLE_DEVICES as `a,b,c` (58fe533): CUDA saw no GPU and the jobs
    silently trained on the CPU."""
    uuid = "GPU-5c3d2b2e-1a2b-3c4d-5e6f-1234567890ab"
    mig = "MIG-8c1f0a3e-0b4e-5f6a-9d2c-0123456789ab"
    assert declared_devices("abc") == ["abc"]
    assert declared_devices("0,1") == ["0", "1"] and declared_devices(3) == ["3"]
    assert declared_devices(None) is None
    assert device_problems(declared_devices([0, 1, uuid, mig, f"MIG-{uuid}/1/0"])) == []
    (problem,) = device_problems(declared_devices([0, "x"]))
    assert problem.startswith("hydra.launcher.devices=['0', 'x']: 'x' is not a GPU; each entry")
    (problem,) = device_problems(declared_devices("abc"))
    assert "'abc' is not a GPU" in problem and "hydra.launcher.devices=[0,1]" in problem
    assert device_problems(["-1"]) and device_problems(["GPU-xyz"]) and device_problems([""])


def _interval(job: Path) -> tuple[float, float]:
    """When a job started (its env.json, written before its ranks) and ended (summary)."""
    return (job / "env.json").stat().st_mtime, (job / "summary.json").stat().st_mtime


@pytest.mark.slow
@pytest.mark.sweeps
def test_four_jobs_share_two_slots_without_overlapping(tmp_path: Path) -> None:
    proc, root = sweep(
        tmp_path, *TINY, "hydra.launcher.devices=[0,1,2,3]", "nproc=2", "seed=1,2,3,4"
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 job(s) on 4 GPU(s) (hydra.launcher.devices: 0,1,2,3), side by side" in proc.stderr
    assert "runner: sweep: 4 done, 0 running, 0 queued, 0 failed; best val/accuracy" in proc.stderr
    jobs = sorted(p for p in root.iterdir() if (p / "summary.json").is_file())
    assert [j.name for j in jobs] == ["0", "1", "2", "3"]
    by_slot: dict[str, list[tuple[float, float]]] = {}
    ports = {}
    for job in jobs:
        header = (job / "logs" / "rank0.log").read_text().splitlines()[0]
        ports[job.name] = header.split(", rendezvous ")[1].split(",")[0]
        assert json.loads((job / "summary.json").read_text())["status"] == "completed"
        devices = json.loads((job / "env.json").read_text())["devices"]
        by_slot.setdefault(devices["CUDA_VISIBLE_DEVICES"], []).append(_interval(job))
        config = (job / "config.yaml").read_text()
        assert "device: cpu" in config  # no GPU here: the ids are handed down, the run is on CPU
    assert sorted(by_slot) == ["0,1", "2,3"] and all(len(v) == 2 for v in by_slot.values())
    for (start_a, end_a), (start_b, end_b) in by_slot.values():
        assert end_a <= start_b or end_b <= start_a, "two jobs in one slot at once"
    first, second = by_slot["0,1"][0], by_slot["2,3"][0]
    assert first[0] < second[1] and second[0] < first[1], "the two slots ran side by side"
    assert ports["0"] != ports["1"], ports  # side by side, each on a port of its own


@pytest.mark.slow
@pytest.mark.sweeps
def test_fail_fast_stops_the_sweep_at_the_first_failure(tmp_path: Path) -> None:
    """Cores as slots (nproc=1: one core each): job 0 loses its rank at step 2 and is
    reported at once; job 1, running beside it, is stopped; job 2 never starts. Job 0 has
    evaluated at step 1: a failed job is found by its summary, not by its missing metric."""
    proc, root = sweep(
        tmp_path, *FAST, "max_epochs=null", "max_steps=100000", "nproc=1", "eval_interval=1",
        "checkpoint.interval=null", "hydra.launcher.devices=[0,1]", "hydra.launcher.fail_fast=true",
        "chaos.kill_rank=0", "chaos.at_step=2,99998,99999",
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    assert "runner: job 0 failed: rank 0 on " in proc.stderr  # the root cause, as it happens
    assert "hydra.launcher.fail_fast=true: the sweep stops (stopping job(s) 1)" in proc.stderr
    assert "job 1 failed" not in proc.stderr  # stopped, not failed (58fe533 said it failed)
    assert "runner: job 1 stopped: interrupted after step" in proc.stderr
    assert "runner: sweep: 0 done, 1 running, 0 queued, 1 failed" in proc.stderr
    assert "runner: 1 queued job(s) never started: 2" in proc.stderr
    summaries = {p.name: json.loads((p / "summary.json").read_text()) for p in root.glob("[0-9]")}
    assert summaries["0"]["status"] == "failed"
    assert summaries["1"]["status"] == "interrupted"
    assert "2" not in summaries and not (root / "2").exists()


@pytest.mark.slow
@pytest.mark.sweeps
@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["hydra.launcher.devices=[0,1,1]"], "1 named twice"),
        (["hydra.launcher.devices=[0,1]", "nproc=1,3"], "nproc=3: a job takes a GPU per rank"),
        (["nodes=2"], "nodes=2: hydra/launcher=runner runs each job on this node"),
        (["hydra.launcher.devices=abc"], "hydra.launcher.devices=['abc']: 'abc' is not a GPU"),
    ],
)
def test_an_impossible_sweep_is_refused_before_its_first_job(
    tmp_path: Path, overrides: list[str], expected: str
) -> None:
    proc, root = sweep(tmp_path, *TINY, *overrides)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "runner: invalid configuration" in proc.stderr and expected in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not root.exists()


@pytest.mark.slow
@pytest.mark.sweeps
@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1"])
def test_a_stopped_sweep_stops_its_running_jobs_and_writes_its_table(
    tmp_path: Path, name: str
) -> None:
    """A signal to the sweep (SIGTERM: a SLURM time limit, `kill`; SIGUSR1: runner's graceful
    stop): each running job is stopped as a run is (interrupted, with its summary; after
    SIGUSR1 with a checkpoint), the queued one never starts, the table is written, and no
    process of the sweep is left."""
    import signal

    import psutil

    from tests.helpers.cli import start_runner, wait_until

    root = tmp_path / "sweep"
    proc = start_runner(
        tmp_path, root, "-m", LAUNCHER, *FAST, "max_epochs=null", "max_steps=100000", "nproc=1",
        "hydra.launcher.devices=[0,1]", "seed=1,2,3", f"hydra.sweep.dir={root}",
    )  # fmt: skip
    started = [root / "0" / "metrics.jsonl", root / "1" / "metrics.jsonl"]
    wait_until(proc, lambda: all(p.exists() for p in started), timeout=HANG)
    proc.send_signal(signal.Signals[name])
    _, err = proc.communicate(timeout=HANG)
    assert proc.returncode == 128 + signal.Signals[name], err  # as a run stopped so ends
    assert f"runner: {name}: stopping every running job; no other starts" in err
    assert "failed" not in err.replace(", 0 failed", ""), err  # stopped is not failed
    assert "runner: job 0 stopped: interrupted after step" in err
    assert "runner: 2 job(s) stopped before their end: 0, 1 (the same command again" in err
    for job in ("0", "1"):
        summary = json.loads((root / job / "summary.json").read_text())
        assert summary["status"] == "interrupted", summary
        if name == "SIGUSR1":  # after its step, with a checkpoint to go on from
            assert (root / job / summary["stopped"]["checkpoint"]).is_dir()
    assert not (root / "2").exists()
    assert "| 1 | seed=2 | interrupted |" in (root / "sweep.md").read_text()
    left = [
        p.info["cmdline"]
        for p in psutil.process_iter(["cmdline"])
        if any(str(root) in part for part in p.info["cmdline"] or [])
    ]
    assert not left, left


@pytest.mark.slow
@pytest.mark.sweeps
def test_a_killed_sweep_run_again_keeps_what_completed_and_resumes_the_rest(
    tmp_path: Path, cli
) -> None:
    """The sweep's process SIGKILLed while job 0 has completed and job 1 runs: job 1 stops
    (interrupted) with it. The same command again keeps job 0 as it was and takes job 1 on
    from its last checkpoint, to the weights of a run that never stopped."""
    import torch

    from tests.helpers.cli import start_runner

    common = [*FAST, "max_epochs=null", "nproc=1", "eval_interval=1000", "log_interval=20"]
    common += ["checkpoint.interval=40"]
    overrides = [*common, "hydra.launcher.devices=[0,1]", "max_steps=8,600"]
    root = tmp_path / "sweep"
    proc = start_runner(tmp_path, root, "-m", LAUNCHER, *overrides, f"hydra.sweep.dir={root}")

    def status(job: str) -> str | None:
        summary = root / job / "summary.json"
        return json.loads(summary.read_text()).get("status") if summary.is_file() else None

    def listed_completed(job: str) -> bool:  # the table: a job's last act, after its summary
        table = root / "sweep.csv"
        return table.is_file() and f"\n{job}," in table.read_text() and status(job) == "completed"

    deadline = time.monotonic() + HANG
    while not (listed_completed("0") and list((root / "1").glob("checkpoints/step_*"))):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.kill()
    proc.communicate(timeout=60)
    while status("1") != "interrupted":  # the kernel's SIGTERM, as the sweep died
        assert time.monotonic() < deadline, status("1")
        time.sleep(0.1)
    kept = (root / "0" / "summary.json").read_bytes()

    again, _ = sweep(tmp_path, *overrides)
    assert again.returncode == 0, again.stdout + again.stderr
    assert (
        f"resuming the sweep in {root}: 1 job(s) kept as they ended, 1 going on from their "
        "last checkpoint, 0 not started yet" in again.stderr
    )
    assert (root / "0" / "summary.json").read_bytes() == kept
    resumed = json.loads((root / "1" / "summary.json").read_text())
    assert resumed["status"] == "completed" and resumed["resumed_from"] > 0, resumed
    # the same slot, so the same threads (declared GPUs on this CPU host: a core a job)
    reference, done = run_sweep(
        tmp_path, LAUNCHER, *common, "hydra.launcher.devices=[0,1]", "max_steps=600",
        root=tmp_path / "uninterrupted",
    )  # fmt: skip
    assert reference.returncode == 0, reference.stdout + reference.stderr
    expected = torch.load(done / "0" / "model.pt", weights_only=True)
    got = torch.load(root / "1" / "model.pt", weights_only=True)
    assert all(torch.equal(expected[k], got[k]) for k in expected)


@pytest.mark.slow
@pytest.mark.sweeps
def test_a_directory_of_another_sweep_or_of_a_run_is_not_resumed(tmp_path: Path, cli) -> None:
    first, root = sweep(tmp_path, *TINY, "seed=1,2")
    assert first.returncode == 0, first.stdout + first.stderr
    record = (root / "multirun.yaml").read_bytes()
    other, _ = sweep(tmp_path, *TINY, "seed=1,3")
    assert other.returncode == 2, other.stdout + other.stderr
    assert (root / "multirun.yaml").read_bytes() == record  # the sweep's own, kept
    assert (
        f"hydra.sweep.dir={root}: its job 1 ran other overrides than this sweep's job 1 "
        "(there only: seed=2; here only: seed=3)" in other.stderr
    )
    run = cli(*TINY, name="run")
    assert run.returncode == 0, run.output
    into_run, _ = run_sweep(tmp_path, LAUNCHER, *TINY, "seed=1,2", root=run.run_dir)
    assert into_run.returncode == 2, into_run.stdout + into_run.stderr
    assert "this directory holds a run, not a sweep's jobs" in into_run.stderr
    assert not (run.run_dir / "multirun.yaml").exists()


@pytest.mark.parametrize(
    ("status", "rerun_failed", "action"),
    [
        ("completed", False, KEEP),
        ("failed", False, KEEP),
        ("failed", True, RESUME),
        ("interrupted", False, RESUME),
        (None, False, RESUME),  # started, never wrote its summary: killed with its sweep
    ],
)
def test_what_a_job_directory_says_of_an_earlier_start(
    tmp_path: Path, status: str | None, rerun_failed: bool, action: str
) -> None:
    assert earlier_start(tmp_path / "0", rerun_failed).action == NEW
    job = tmp_path / "0"
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("- seed=1\n")
    (job / "config.yaml").write_text("sweep:\n  metric: val/accuracy\n")
    if status is not None:
        summary = {"status": status, "final": {"val/accuracy": 0.5}}
        (job / "summary.json").write_text(json.dumps(summary))
    start = earlier_start(job, rerun_failed)
    assert start.action == action
    assert (start.value == 0.5) == (status == "completed")


def test_every_node_of_a_slurm_job_goes_on_from_what_the_first_node_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """submitit starts a multi-node job on each node; node 0 writes the job's directory
    before node 1 looks there, and node 1 must not take that for an earlier start (it did:
    `resume: 'auto' here, None on node 0`, and the job failed)."""
    job, overrides = tmp_path / "0", ["seed=1"]
    job.mkdir()
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    node0 = as_first_node_found_it(job, earlier_job(job, overrides, None))
    assert node0.start.action == NEW
    (job / ".hydra").mkdir()  # node 0 goes on: its Hydra files, half written as node 1 looks
    mid_write = as_first_node_found_it(job, earlier_job(job, overrides, None))
    assert mid_write == node0  # it was 'holds another job': node 1 left, node 0 waited 900 s
    (job / ".hydra" / "overrides.yaml").write_text("- seed=1\n")
    assert earlier_job(job, overrides, None).start.action == RESUME  # what node 1 would see
    assert as_first_node_found_it(job, earlier_job(job, overrides, None)).start.action == NEW
    # The same command again, a new SLURM job: the directory holds an interrupted start.
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    again = as_first_node_found_it(job, earlier_job(job, overrides, None))
    assert again.start.action == RESUME
    assert as_first_node_found_it(job, earlier_job(job, overrides, None)).start.action == RESUME


def test_the_progress_line_counts_jobs_and_names_the_best(tmp_path: Path) -> None:
    progress = SweepProgress(queued=3)
    for job, (status, accuracy) in enumerate([("completed", 0.8), ("failed", None)]):
        progress.started()
        job_dir = tmp_path / str(job)
        job_dir.mkdir()
        (job_dir / "config.yaml").write_text(
            "sweep:\n  metric: val/accuracy\n  direction: maximize\n"
        )
        final = {} if accuracy is None else {"val/accuracy": accuracy}
        (job_dir / "summary.json").write_text(json.dumps({"status": status, "final": final}))
        progress.ended(job, job_dir)
    assert (
        progress.line()
        == "sweep: 1 done, 0 running, 1 queued, 1 failed; best val/accuracy 0.8 (job 0)"
    )


def test_without_a_gpu_driver_the_slots_are_this_process_s_cores() -> None:
    import os
    import shutil

    if shutil.which("nvidia-smi") is not None:
        pytest.skip("a GPU driver is here")
    pool = device_pool(None, {"CUDA_VISIBLE_DEVICES": "0,1"})  # no driver: the ids mean nothing
    assert pool.kind == CPU and not pool.declared
    assert pool.devices == tuple(str(c) for c in sorted(os.sched_getaffinity(0)))


HYDRA_APP = """
import json
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf


@hydra.main(version_base="1.3", config_path=None, config_name=None)
def main(cfg) -> float:
    out = Path(HydraConfig.get().runtime.output_dir) / "job.json"
    out.write_text(json.dumps(OmegaConf.to_container(cfg)))
    return float(cfg.a)


if __name__ == "__main__":
    main()
"""


@pytest.mark.slow
@pytest.mark.sweeps
def test_a_hydra_app_of_its_own_gets_the_config_hydra_composed(tmp_path: Path) -> None:
    """Not runner's: side by side, each job's config is what Hydra composed (no key of
    runner's added to quiet the bars), and a job that returned is done, not failed."""
    (tmp_path / "app.py").write_text(HYDRA_APP)
    root = tmp_path / "sweep"
    sweep_args = ["-m", "hydra/launcher=runner", "+a=0,1", f"hydra.sweep.dir={root}"]
    proc = subprocess.run(
        [sys.executable, "app.py", *sweep_args],
        cwd=tmp_path, capture_output=True, text=True, timeout=HANG, env=child_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "side by side" in proc.stderr
    assert "sweep: 2 done, 0 running, 0 queued, 0 failed" in proc.stderr, proc.stderr
    for job in ("0", "1"):
        assert json.loads((root / job / "job.json").read_text()) == {"a": int(job)}
