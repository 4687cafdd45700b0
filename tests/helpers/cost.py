"""The suite's cost ledger, a pytest plugin: each test module's wall and CPU seconds (its own
and its children's: the runs, their agents and ranks), its tests and the runs it launched,
recorded into `.test-cost/<target>.json` for `make test-report` (tests/helpers/cost_report.py).

A module's time runs from its first test's setup to its last test's teardown, module-scoped
fixtures (the runs its tests share) included. Children's CPU seconds are what the kernel
counts for the processes a test waited for, and theirs (a run's agent waits for its ranks);
a process nobody waits for (Ray's own daemons) is not seen; multiprocessing's fork server,
which outlives the tests that start ranks from it, is read as it runs. Under pytest-xdist
each worker measures the modules it runs and hands its records to the controller, which
writes the file.

The target is `RUNNER_TEST_TARGET` (the Makefile sets it: test, test-matrix, ...), else the
`-m` expression, else "pytest"; a run that selects files or tests by hand (pytest tests/x.py,
-k) records under "partial" so it never overwrites a whole target's ledger."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest

LEDGER_DIR = Path(__file__).resolve().parents[2] / ".test-cost"
_WORKER_KEY = "runner_test_cost"


@dataclass
class ScopeCost:
    scope: str  # what pytest-xdist hands a worker whole: tests/test_x.py, or tests/test_x.py::TestY
    wall_s: float = 0.0
    cpu_s: float = 0.0  # this process: the test's own Python (composition, plain references)
    children_cpu_s: float = 0.0  # the processes it started and waited for
    tests: int = 0
    failed: int = 0
    runs: int = 0  # `runner ...` commands started (a run, a sweep, eval, export, plan)
    processes: int = 0  # every child process started (runs included)
    commands: list[str] = field(default_factory=list)  # the runs' arguments, as typed
    # each test's [name, wall s, CPU s (own and children's), runs]; a module-scoped
    # fixture's run is charged to the first test that asked for it
    test_costs: list[list] = field(default_factory=list)


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime + _forkserver_cpu()


def _forkserver_cpu() -> float:
    """multiprocessing's fork server (tests/helpers/ranks.py) and runner's warm server
    (tests/helpers/warm.py) live on between tests: their own CPU seconds and those of the
    ranks and agents they forked and reaped, so far."""
    from multiprocessing import forkserver

    from tests.helpers import warm

    pids = [getattr(forkserver._forkserver, "_forkserver_pid", None), warm.server_pid()]
    return sum(_cpu_of(pid) for pid in pids if pid)


def _cpu_of(pid: int) -> float:
    try:
        import psutil

        times = psutil.Process(pid).cpu_times()
    except Exception:  # gone, or no psutil: what it cost is the kernel's to count
        return 0.0
    return times.user + times.system + times.children_user + times.children_system


def is_runner_command(args: object) -> bool:
    """Whether a child's argv starts the runner command (any subcommand) or runner-report."""
    if not isinstance(args, list | tuple) or not args:
        return False
    words = [str(a) for a in args]
    if "runner.cli.entry" in words or "runner.cli.report" in words:
        return True
    return Path(words[0]).name in ("runner", "runner-report")


_RECORDER: list[CostRecorder] = []


def note_started(args: list[str]) -> None:
    """A child started other than by subprocess (tests.helpers.terminal's pseudo-terminal)."""
    for recorder in _RECORDER:
        recorder.processes += 1
        if is_runner_command(args):
            recorder.runs += 1
            recorder.commands.append(shown_command(args))


def shown_command(args: list | tuple) -> str:
    """A run's arguments as a user would type them: `runner` and its overrides, without the
    run directory a test chose (temporary paths shortened to their last part)."""
    words = [str(a) for a in args]
    if "runner.cli.entry" in words:
        words = ["runner", *words[words.index("runner.cli.entry") + 1 :]]
    kept = [w for w in words if not w.startswith(("hydra.run.dir=", "hydra.sweep.dir="))]
    return " ".join(_TEMP.sub(r"\1", w) for w in kept)[:400]


_TEMP = re.compile(r"/tmp/\S*/([^/\s]+)")


class CostRecorder:
    """Measures each module this process runs; see the module's docstring."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.scopes: dict[str, ScopeCost] = {}
        self._open: tuple[str, float, float, float] | None = None
        self.runs = 0
        self.processes = 0
        self.commands: list[str] = []
        self._started = time.time()
        self._install_counters()
        _RECORDER.append(self)

    def _install_counters(self) -> None:
        recorder = self
        popen_init = subprocess.Popen.__init__

        def counting_init(popen, args, *rest, **kwargs):
            recorder.processes += 1
            if is_runner_command(args):
                recorder.runs += 1
                recorder.commands.append(shown_command(args))
            popen_init(popen, args, *rest, **kwargs)

        subprocess.Popen.__init__ = counting_init  # type: ignore[method-assign]
        import multiprocessing.process

        start = multiprocessing.process.BaseProcess.start

        def counting_start(process):
            recorder.processes += 1
            start(process)

        multiprocessing.process.BaseProcess.start = counting_start  # type: ignore[method-assign]

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):
        scope = scope_of(item)
        if self._open is None or self._open[0] != scope:
            self._close()
            own, kids = _cpu()
            self._open = (scope, time.monotonic(), own, kids)
            self.scopes.setdefault(scope, ScopeCost(scope))
            self._marks = (self.runs, self.processes)
        wall0, runs0, (own0, kids0) = time.monotonic(), self.runs, _cpu()
        yield
        own, kids = _cpu()
        cost = self.scopes[scope]
        cost.tests += 1
        name = item.nodeid.split("::", 1)[-1]
        spent = [round(time.monotonic() - wall0, 2), round(own + kids - own0 - kids0, 2)]
        cost.test_costs.append([name, *spent, self.runs - runs0])
        if nextitem is None or scope_of(nextitem) != scope:
            self._close()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed and self._open is not None:
            self.scopes[self._open[0]].failed += 1

    def _close(self) -> None:
        if self._open is None:
            return
        scope, wall0, own0, kids0 = self._open
        own, kids = _cpu()
        cost = self.scopes[scope]
        cost.wall_s += time.monotonic() - wall0
        cost.cpu_s += own - own0
        cost.children_cpu_s += kids - kids0
        cost.commands += self.commands[self._marks[0] :]
        cost.runs += self.runs - self._marks[0]
        cost.processes += self.processes - self._marks[1]
        self._open = None

    def records(self) -> list[dict]:
        self._close()
        return [asdict(cost) for cost in self.scopes.values()]

    # --- pytest-xdist: workers hand their records to the controller
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        workeroutput = getattr(self.config, "workeroutput", None)
        if workeroutput is not None:  # a worker: the controller writes the file
            workeroutput[_WORKER_KEY] = json.dumps(self.records())
            return
        self._write(self.records(), session)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        kept = getattr(node, "workeroutput", {}).get(_WORKER_KEY)
        for record in json.loads(kept) if kept else []:
            merged = self.scopes.setdefault(record["scope"], ScopeCost(record["scope"]))
            for key, value in record.items():
                if key != "scope":
                    setattr(merged, key, getattr(merged, key) + value)

    def _write(self, records: list[dict], session: pytest.Session) -> None:
        if not records:
            return
        target = _target(self.config)
        LEDGER_DIR.mkdir(exist_ok=True)
        ledger = {
            "target": target,
            "started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self._started)),
            "wall_s": round(time.time() - self._started, 1),
            "workers": _workers(self.config),
            "exitstatus": int(session.exitstatus),
            "load_at_start": round(os.getloadavg()[0], 2),
            "scopes": sorted(records, key=lambda r: -r["wall_s"]),
        }
        path = LEDGER_DIR / f"{target}.json"
        path.with_suffix(".tmp").write_text(json.dumps(ledger, indent=1) + "\n")
        path.with_suffix(".tmp").replace(path)


def scope_of(item: pytest.Item) -> str:
    """pytest-xdist's --dist loadscope unit: the module of a test function, the class of a
    test method (its id up to the last `::`, parameters left out)."""
    return item.nodeid.split("[", 1)[0].rsplit("::", 1)[0]


def _workers(config: pytest.Config) -> int:
    return int(getattr(config.option, "numprocesses", 0) or 0)


def _target(config: pytest.Config) -> str:
    by_hand = config.args != [str(a) for a in config.getini("testpaths")] and config.args != []
    if by_hand and any(not Path(a).is_dir() for a in config.args) or config.option.keyword:
        return "partial"
    named = os.environ.get("RUNNER_TEST_TARGET")
    if named:
        return named
    marks = (config.option.markexpr or "").strip()
    return "-m " + marks if marks else "pytest"


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("RUNNER_TEST_COST", "1") != "0" and not hasattr(config, "_runner_cost"):
        config._runner_cost = CostRecorder(config)  # type: ignore[attr-defined]
        config.pluginmanager.register(config._runner_cost, "runner_test_cost")
