"""start_method=forkserver: ranks forked from a process that imported torch start as spawned
ones would (environment, arguments, streams, signals, session, seeds, threads), end as the
agent expects, die with their fork server, and train the same weights bit for bit."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from runner.spec import SpecError, resolve_spec
from tests.helpers.cli import REPO, child_env, start_runner, wait_until
from tests.helpers.config import compose_config

# Run in a new interpreter, as the agent's first act is: the fork server is forked from a
# process without threads. Prints one JSON line per result.
DRIVER = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    from runner.launch.forked_ranks import ForkServer, ForkServerError
    server = ForkServer.start()
    env = dict(os.environ, OPENBLAS_NUM_THREADS="2", PROBE_MARK="yes")
    def command(*args):
        return [sys.executable, "-u", "-m", "tests.helpers.forked_probe", *args]
    def report(**values):
        print(json.dumps(values), flush=True)
    {body}
    """
)


def drive(tmp_path: Path, body: str, timeout: float = 120) -> tuple[list[dict], str]:
    """Run DRIVER with `body`: its JSON lines, and everything on its stdout."""
    env = child_env()
    env["OPENBLAS_NUM_THREADS"] = "1"  # the fork server's own OpenBLAS pool: one thread
    code = DRIVER.format(body=textwrap.indent(textwrap.dedent(body), "").strip())
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return lines, result.stdout


@pytest.mark.slow
def test_a_forked_rank_starts_as_a_spawned_one(tmp_path: Path) -> None:
    outs = [tmp_path / f"{name}.json" for name in ("fork1", "fork2", "spawn")]
    (result,), stdout = drive(
        tmp_path,
        f"""
        codes = [server.spawn(command(out), env).wait(60) for out in {[str(o) for o in outs[:2]]}]
        spawned = subprocess.run(command({str(outs[2])!r}), env=env, start_new_session=True)
        report(codes=codes + [spawned.returncode])
        """,
    )
    assert result["codes"] == [0, 0, 0]
    assert stdout.count("probe: on stdout") == 3  # the forks wrote to the agent's stdout
    fork1, fork2, spawn = (json.loads(out.read_text()) for out in outs)
    for key in ("cwd", "path_head", "session_leader", "blas_threads", "stdout_write_through"):
        assert fork1[key] == spawn[key], key
    assert fork1["blas_threads"] == [2]  # the rank's OPENBLAS_NUM_THREADS, not the server's 1
    # the same but for the output file each was given
    assert fork1["argv"] == [spawn["argv"][0], str(outs[0])]
    shown = " ".join(fork1["cmdline"])  # as ps shows it (one string, from setproctitle)
    assert shown == " ".join([*spawn["cmdline"][:-1], str(outs[0])])
    ours = {"RUNNER_RANK_PARENT_PID", "RUNNER_FORKED"}
    assert {k: v for k, v in fork1["env"].items() if k not in ours} == spawn["env"]
    assert fork1["env"]["PROBE_MARK"] == "yes"
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGCHLD", "SIGPIPE"):
        assert fork1["signals"][name] == spawn["signals"][name], name
    # SLURM's --signal reaches every process: a rank ignores it from its first instant
    assert fork1["signals"]["SIGUSR1"] == fork1["signals"]["SIGUSR2"] == "<Handlers.SIG_IGN: 1>"
    assert fork1["threads"] == spawn["threads"]
    assert fork1["fds"] == spawn["fds"], "the fork server's descriptors leaked into the rank"
    assert fork1["numpy_draw"] != fork2["numpy_draw"]  # seeded afresh, as a new process is
    assert fork1["dynamo_loaded"] and not spawn["dynamo_loaded"]  # what the server is for


@pytest.mark.slow
def test_exit_codes_signals_and_the_server_s_death(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    (result,), _ = drive(
        tmp_path,
        f"""
        exits = server.spawn(command({str(out)!r}, "exit", "3"), env).wait(60)
        rank = server.spawn(command({str(out)!r}, "sleep"), env)
        while not os.path.exists({str(out)!r}) or os.path.getsize({str(out)!r}) == 0:
            time.sleep(0.05)
        try:
            rank.wait(timeout=0.2)
            waited = "returned"
        except subprocess.TimeoutExpired:
            waited = "timed out"
        rank.send_signal(signal.SIGTERM)
        terminated = rank.wait(30)
        orphan = server.spawn(command({str(out)!r}, "sleep"), env)
        time.sleep(0.5)
        os.kill(server.pid, signal.SIGKILL)
        os.waitpid(server.pid, 0)
        after = orphan.wait(5)
        try:
            server.spawn(command({str(out)!r}), env)
            again = "forked"
        except ForkServerError as exc:
            again = str(exc)
        report(exits=exits, waited=waited, terminated=terminated, orphan=orphan.pid,
               after=after, again=again)
        """,
    )
    assert result["exits"] == 3
    assert result["waited"] == "timed out"
    assert result["terminated"] == -signal.SIGTERM  # as subprocess.Popen reports it
    assert result["after"] == -signal.SIGKILL
    assert "gone" in result["again"] or "ended" in result["again"]
    deadline = time.time() + 5  # PR_SET_PDEATHSIG: the rank died with its server
    while psutil.pid_exists(result["orphan"]) and time.time() < deadline:
        with_status = psutil.Process(result["orphan"])
        if with_status.status() == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.05)
    alive = psutil.pid_exists(result["orphan"])
    assert not alive or psutil.Process(result["orphan"]).status() == psutil.STATUS_ZOMBIE


@pytest.mark.slow
def test_a_server_with_a_thread_refuses_to_fork(tmp_path: Path) -> None:
    (result,), _ = drive(
        tmp_path,
        """
        server.preload(["tests.helpers.thread_at_import"])
        try:
            server.spawn(command("unused"), env)
            report(error=None)
        except ForkServerError as exc:
            report(error=str(exc))
        """,
    )
    assert result["error"] and "threads" in result["error"]


FAST = ["model=mlp", "data=synthetic", "nproc=2", "global_batch_size=32", "max_epochs=null"]
FAST += ["eval_interval=1000000", "progress_bar=false", "logger=none"]


@pytest.mark.slow
def test_forked_and_spawned_ranks_train_the_same_weights(cli) -> None:
    import torch

    runs = {
        method: cli(*FAST, "max_steps=30", f"start_method={method}", name=method)
        for method in ("forkserver", "spawn")
    }
    for method, result in runs.items():
        assert result.returncode == 0, result.output
        started = "forked by the fork server" if method == "forkserver" else "spawned"
        assert started in result.rank_log(1).splitlines()[0], result.rank_log(1)[:300]
    weights = {m: torch.load(r.run_dir / "model.pt", weights_only=True) for m, r in runs.items()}
    forked, spawned = weights["forkserver"], weights["spawn"]
    assert forked.keys() == spawned.keys()
    assert all(torch.equal(forked[k], spawned[k]) for k in forked)


@pytest.mark.slow
@pytest.mark.cold_start  # it reads the command's process tree: its agent a child
def test_killing_the_agent_takes_the_server_and_the_ranks_with_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_runner(tmp_path, run_dir, *FAST, "max_steps=100000", "log_interval=5")
    everything = [psutil.Process(proc.pid)]
    try:
        metrics = run_dir / "metrics.jsonl"
        wait_until(proc, lambda: metrics.exists() and metrics.read_text().count("\n") >= 2, 60)
        everything += everything[0].children(recursive=True)
        agent = next(p for p in everything if "runner.launch.agent" in p.cmdline())
        below = agent.children(recursive=True)
        titles = [" ".join(p.cmdline()) for p in below]
        assert any("runner fork server" in t for t in titles), titles
        assert sum("-m runner.train.worker" in t for t in titles) == 2, titles
        agent.kill()
        _, alive = psutil.wait_procs(below, timeout=5)
        assert not alive, f"left behind: {alive}"
        proc.communicate(timeout=30)
        assert proc.returncode != 0
    finally:  # a failed assertion leaves no run training in the background
        for process in everything:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


@pytest.mark.parametrize(
    ("platform", "method", "expected"),
    [("linux", "auto", "forkserver"), ("darwin", "auto", "spawn"), ("linux", "spawn", "spawn")],
)
def test_start_method_auto_forks_on_linux_only(monkeypatch, platform, method, expected) -> None:
    monkeypatch.setattr(sys, "platform", platform)
    spec = resolve_spec(compose_config([f"start_method={method}", "device=cpu"]), cuda_devices=0)
    assert spec.start_method == expected


def test_forkserver_outside_linux_is_refused_before_any_rank_starts(monkeypatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(SpecError) as info:
        resolve_spec(compose_config(["start_method=forkserver", "device=cpu"]), cuda_devices=0)
    assert "start_method=forkserver: forking ranks is safe only on Linux, not darwin" in str(
        info.value
    )
    assert "valid here: auto, spawn" in str(info.value)


@pytest.mark.slow  # importing torch elastic runs ldconfig (ctypes' find_library)
def test_this_torch_still_offers_the_hook_the_fork_server_replaces() -> None:
    """The fork server replaces a private part of torch elastic (runner.launch.forked_ranks):
    the module-level `get_subprocess_handler` that SubprocessContext calls to start each rank,
    and SubprocessHandler's `_popen(args, env)` and `close(death_sig)`. After a torch upgrade
    this says at once whether forking still works (where the hook moves, runner spawns the
    ranks instead, with a warning)."""
    import inspect

    from runner.launch.forked_ranks import elastic_hook

    hook = elastic_hook()
    assert hook is not None, "torch elastic's process-start hook moved: ranks would be spawned"
    api, handler = hook
    assert "get_subprocess_handler(" in inspect.getsource(api.SubprocessContext._start)
    made_by = list(inspect.signature(api.get_subprocess_handler).parameters)
    takes = list(inspect.signature(handler.__init__).parameters)[1:]  # after self
    assert made_by == takes, (made_by, takes)
    assert list(inspect.signature(handler._popen).parameters) == ["self", "args", "env"]
    assert list(inspect.signature(handler.close).parameters)[:2] == ["self", "death_sig"]


@pytest.mark.parametrize(
    ("overrides", "imports_it"),
    [
        (["parallelism=zero2", "device=cpu"], True),
        (["parallelism=zero3", "device=cpu"], True),
        (["compile=true", "device=cpu"], True),
        (["parallelism=fsdp", "device=cpu"], False),
        (["parallelism=zero2", "device=cuda"], False),  # a GPU's ranks import it themselves
    ],
)
def test_the_server_imports_torch_s_compiler_for_the_cpu_ranks_that_load_it(
    overrides: list[str], imports_it: bool
) -> None:
    """DeepSpeed's ranks and compiled ones import torch._inductor (seconds of CPU each): on
    the CPU the fork server imports it once for all of them."""
    from runner.launch.forked_ranks import COMPILER, DEEPSPEED_ON_CPU, modules_for

    spec = resolve_spec(compose_config(overrides), cuda_devices=2)
    assert (COMPILER in modules_for(spec)) == imports_it
    zero_on_cpu = imports_it and "compile=true" not in overrides  # and DeepSpeed, as it loads there
    assert (DEEPSPEED_ON_CPU in modules_for(spec)) == zero_on_cpu


def test_the_server_imports_a_transformers_model_class_for_the_ranks() -> None:
    """transformers loads a model's modeling module on first use: the server asks for the
    class itself (about 2 s of CPU a rank here, made once)."""
    from runner.launch.forked_ranks import modules_for

    target = "model._target_=transformers.LlamaForCausalLM"
    spec = resolve_spec(compose_config(["model=custom", target, "device=cpu"]))
    assert "transformers:LlamaForCausalLM" in modules_for(spec)
    on_a_gpu = resolve_spec(compose_config(["model=custom", target, "device=cuda"]), cuda_devices=2)
    assert not any(m.startswith("transformers") for m in modules_for(on_a_gpu))  # not measured
    default = modules_for(resolve_spec(compose_config([])))
    assert not any(m.startswith("transformers") for m in default)
