"""The suite's fixtures: runs shared between tests, a temporary token cache, the fast tier's
rule. What tests import (running the command, FAST, ...) is in tests/helpers/cli.py."""

from __future__ import annotations

import atexit
import json
import multiprocessing.process
import os
import random
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.helpers.cli import HANG, ONE_THREAD, RESTARTABLE, ZERO2_OFFLOAD, CliResult, run_cli

# The tests' own torch (plain-PyTorch references, in-process checks) on one thread too,
# before anything imports torch: see ONE_THREAD.
for _name, _value in ONE_THREAD.items():
    os.environ.setdefault(_name, _value)

# Token caches (data=text) go to one temporary cache for the session, shared by its runs,
# never to the user's ~/.cache/runner.
os.environ["RUNNER_CACHE_DIR"] = tempfile.mkdtemp(prefix="runner-test-cache-")
atexit.register(shutil.rmtree, os.environ["RUNNER_CACHE_DIR"], True)


# The suite's cost ledger (make test-report): each module's wall and CPU seconds and its runs.
pytest_plugins = ["tests.helpers.cost"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (a module or class to a worker, handed out in the order collected:
    --no-loadscope-reorder), the longest first by their recorded wall seconds
    (tests/durations.json, or this machine's last record: make test-report), so that the
    workers end together instead of one running a long module alone at the end; a scope not
    recorded yet goes first (a scope under 0.1 s is not recorded: those go first too, and
    cost nothing). Alone, pytest's own order is kept."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    from tests.helpers.cost import scope_of
    from tests.helpers.cost_report import recorded_durations

    durations = recorded_durations(os.environ.get("RUNNER_TEST_TARGET", ""))
    first_seen: dict[str, int] = {}
    for item in items:
        first_seen.setdefault(scope_of(item), len(first_seen))

    def longest_first(item: pytest.Item) -> tuple[float, int]:
        scope = scope_of(item)
        return -durations.get(scope, float("inf")), first_seen[scope]

    items.sort(key=longest_first)


@pytest.fixture
def cli(tmp_path: Path):
    """`cli(*overrides)` runs the runner command in a fresh temporary directory."""

    def call(*overrides: str, name: str = "run", timeout: float = HANG) -> CliResult:
        return run_cli(tmp_path, *overrides, name=name, timeout=timeout)

    return call


def once_per_session(tmp_path_factory, name: str, *overrides: str) -> CliResult:
    """A run that the tests of every pytest-xdist worker only read, made once: the first
    worker to ask runs it, under a lock the others wait on, and leaves its output beside it
    for them (each worker's session fixtures are its own, so each ran it before)."""
    from runner.rundir.files import file_lock

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / f"shared-{name}"
    with file_lock(root.with_name(root.name + ".lock")):
        record = root / "result.json"
        if record.is_file():
            kept = json.loads(record.read_text())
            return CliResult(kept["returncode"], kept["stdout"], kept["stderr"], root / name)
        root.mkdir(parents=True, exist_ok=True)
        result = run_cli(root, *overrides, name=name)
        outcome = {"returncode": result.returncode, "stdout": result.stdout}
        record.write_text(json.dumps({**outcome, "stderr": result.stderr}))
    return result


@pytest.fixture(scope="session")
def default_run(tmp_path_factory) -> CliResult:
    """`runner` as a user types it, with every default (mlp on digits, 2 ranks, 12 epochs =
    276 steps; the progress bar, as plain lines off a terminal), run once for the artifact
    checks, for runner-report, and as the uninterrupted twin of the SIGTERM resume test."""
    result = once_per_session(tmp_path_factory, "default")
    assert result.returncode == 0, result.output
    return result


@pytest.fixture(scope="session")
def zero2_offload_run(tmp_path_factory) -> CliResult:
    """One uninterrupted RESTARTABLE run with ZeRO-2 offloading to the CPU, shared by the
    optimizer-state test and the zero2 restart test (one run fewer in `make test`)."""
    result = once_per_session(tmp_path_factory, "zero2", *RESTARTABLE, *ZERO2_OFFLOAD)
    assert result.returncode == 0, result.output
    return result


# ------------------------------------------------------------------ warm agents


@pytest.fixture(scope="module", autouse=True)
def _warm_agents(request):
    """Each run's agent forked from this process's warm server (tests/helpers/warm.py), in a
    module with a run that does not say COLD_START = True; a new interpreter otherwise."""
    from runner.processes import WARM_SERVER_ENV as SERVER_ENV
    from tests.helpers import warm

    module = request.module
    runs = any(
        item.module is module and item.get_closest_marker("slow") is not None
        for item in request.session.items
    )
    if runs and not getattr(module, "COLD_START", False):
        os.environ[SERVER_ENV] = warm.start()
    else:
        os.environ.pop(SERVER_ENV, None)
    yield
    os.environ.pop(SERVER_ENV, None)


@pytest.fixture(autouse=True)
def _cold_start(request, monkeypatch):
    """A test marked cold_start runs its commands without the warm server."""
    if request.node.get_closest_marker("cold_start") is not None:
        from runner.processes import WARM_SERVER_ENV as SERVER_ENV

        monkeypatch.delenv(SERVER_ENV, raising=False)


def pytest_sessionfinish(session) -> None:
    from tests.helpers import warm

    warm.stop()


# ------------------------------------------------------------------ the fast tier
# `make test-fast` runs the tests not marked slow; a test that starts a process (a run, a
# rank, a child interpreter) is slow by definition, and this holds it to that.


LOOKUPS = {"ldconfig", "fc-list"}


@pytest.fixture(autouse=True)
def _fast_tests_start_no_process(request, monkeypatch):
    if request.node.get_closest_marker("slow") is not None:
        yield
        return
    started: list[str] = []
    popen_init = subprocess.Popen.__init__
    process_start = multiprocessing.process.BaseProcess.start

    def noting_popen(self, args, *rest, **kwargs):
        # lookups, not a run, a rank or a worker: ctypes.util.find_library asks ldconfig
        # where a shared library is (a library's first import can), and matplotlib's first
        # import on a machine lists its fonts with fc-list (then keeps them in its cache)
        if not (isinstance(args, list | tuple) and Path(str(args[0])).name in LOOKUPS):
            started.append(f"subprocess {args!r}"[:200])
        popen_init(self, args, *rest, **kwargs)

    def noting_start(self):
        started.append(f"multiprocessing {self!r}")
        process_start(self)

    monkeypatch.setattr(subprocess.Popen, "__init__", noting_popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", noting_start)
    yield
    assert not started, (
        f"{request.node.nodeid} starts processes; mark it @pytest.mark.slow: {started[0]}"
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A small text corpus (three documents of random words), one per test module."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "runner", "token", "batch", "rank", "step"]
    for i in range(3):
        text = " ".join(rng.choice(words) for _ in range(400))
        (root / f"doc{i}.txt").write_text(text + "\n")
    return root


@pytest.fixture(scope="module")
def mlp_reference() -> dict:
    """Plain PyTorch's weights after the mlp run of the equivalence tests (tests.helpers
    .equivalence.ARGS), trained in one process on whole global batches."""
    from runner.spec import resolve_spec
    from tests.helpers import equivalence
    from tests.helpers.config import compose_config

    spec = resolve_spec(compose_config([*equivalence.ARGS, "nproc=1", "device=cpu"]))
    return equivalence.train_plain(spec)


@pytest.fixture(scope="module")
def lm_reference(corpus: Path) -> dict:
    """Plain PyTorch's weights after the gpt run of the language-model tests on `corpus`."""
    from runner.spec import resolve_spec
    from tests.helpers import language_model
    from tests.helpers.config import compose_config

    spec = resolve_spec(compose_config([*language_model.lm_args(corpus), "nproc=1", "device=cpu"]))
    return language_model.train_plain(spec)
