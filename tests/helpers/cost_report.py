"""`make test-report`: what each test module cost in the last run of each target, from the
ledger tests/helpers/cost.py records (.test-cost/<target>.json), most expensive first; and the
schedule the suite starts its modules in, derived from those records.

    python -m tests.helpers.cost_report [TARGET ...] [--top N] [--scopes] [--runs MODULE]
                                        [--tests MODULE]
    python -m tests.helpers.cost_report --schedule   # rewrite tests/durations.json

tests/durations.json (checked in) holds each scope's wall seconds as last recorded; the
conftest starts the scopes of a run longest first by it (a local record of a whole target
takes precedence), so that pytest-xdist's workers end together. A scope it does not know yet
(a new module) starts first: its cost is found out early, not in the tail."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from tests.helpers.cost import LEDGER_DIR

SCHEDULE = Path(__file__).resolve().parents[1] / "durations.json"
TARGETS = (
    "test-fast", "test", "test-matrix", "test-sweeps", "test-ray", "test-slurm", "test-floor",
)  # fmt: skip


def ledgers() -> dict[str, dict]:
    """The last record of each target, in .ci/run's order (others after)."""
    found = {}
    for path in sorted(LEDGER_DIR.glob("*.json")) if LEDGER_DIR.is_dir() else []:
        try:
            found[path.stem] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # one being written, or damaged: the others still report
    order = {name: i for i, name in enumerate(TARGETS)}
    return dict(sorted(found.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))


def by_module(ledger: dict) -> list[dict]:
    """A target's scopes summed per module (a module's classes can run on several workers)."""
    modules: dict[str, dict] = {}
    for scope in ledger["scopes"]:
        name = scope["scope"].split("::", 1)[0]
        row = modules.setdefault(name, {"module": name})
        for key, value in scope.items():
            if key != "scope":
                row[key] = row.get(key, [] if isinstance(value, list) else 0) + value
    return sorted(modules.values(), key=lambda r: -r["wall_s"])


def recorded_durations(target: str) -> dict[str, float]:
    """Each scope's wall seconds in `target` (its tests of the scope, not another target's):
    the checked-in schedule, then this machine's last record of that target. A target never
    recorded (pytest run by hand) takes each scope's longest in any target."""
    schedule: dict[str, dict[str, float]] = {}
    with contextlib.suppress(OSError, json.JSONDecodeError):
        schedule = json.loads(SCHEDULE.read_text())
    for name, ledger in ledgers().items():
        if name != "partial" and ledger.get("exitstatus") in (0, 1):
            recorded = {s["scope"]: s["wall_s"] for s in ledger["scopes"]}
            schedule.setdefault(name, {}).update(recorded)
    if target in schedule:
        return schedule[target]
    longest: dict[str, float] = {}
    for durations in schedule.values():
        for scope, seconds in durations.items():
            longest[scope] = max(seconds, longest.get(scope, 0.0))
    return longest


def write_schedule() -> Path:
    """tests/durations.json from the last record of each target (the others kept)."""
    schedule: dict[str, dict[str, float]] = {}
    with contextlib.suppress(OSError, json.JSONDecodeError):
        schedule = json.loads(SCHEDULE.read_text())
    root = SCHEDULE.parents[1]
    existing = {p.relative_to(root).as_posix() for p in SCHEDULE.parent.rglob("test_*.py")}
    for target, ledger in ledgers().items():
        if target == "partial":
            continue
        recorded = {s["scope"]: round(s["wall_s"], 1) for s in ledger["scopes"]}
        schedule[target] = {
            scope: seconds
            for scope, seconds in sorted(recorded.items())
            if scope.split("::", 1)[0] in existing and seconds >= 0.1
        }
    SCHEDULE.write_text(json.dumps(dict(sorted(schedule.items())), indent=1) + "\n")
    return SCHEDULE


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def report(
    targets: list[str], top: int, scopes: bool, runs_of: str = "", tests_of: str = ""
) -> str:
    lines: list[str] = []
    found = ledgers()
    if not found:
        return f"no ledger yet under {LEDGER_DIR}: run make test (or any make test-*) first"
    if unknown := [t for t in targets if t not in found]:
        return (
            f"no record of {', '.join(unknown)} under {LEDGER_DIR} (recorded: "
            f"{', '.join(found)}): run make {unknown[0]} first"
        )
    totals = []
    listed = False
    for target, ledger in found.items():
        if targets and target not in targets:
            continue
        rows = ledger["scopes"] if scopes else by_module(ledger)
        rows = sorted(rows, key=lambda r: -r["wall_s"])
        cpu = sum(r["cpu_s"] + r["children_cpu_s"] for r in rows)
        tests, runs = sum(r["tests"] for r in rows), sum(r["runs"] for r in rows)
        totals.append((target, ledger["wall_s"], tests, runs, cpu))
        lines.append(
            f"\n{target}: {_minutes(ledger['wall_s'])} wall, {ledger['workers'] or 1} worker(s), "
            f"{tests} tests, {runs} runs, {_minutes(cpu)} CPU; started {ledger['started']} "
            f"(load {ledger['load_at_start']}), exit status {ledger['exitstatus']}"
        )
        name = "scope" if scopes else "module"
        width = max([len(r[name]) for r in rows[:top]] + [len(name)])
        lines.append(f"  {name:<{width}}  {'wall s':>7}  {'CPU s':>7}  {'ranks s':>7}  tests  runs")
        for r in rows[:top]:
            lines.append(
                f"  {r[name]:<{width}}  {r['wall_s']:7.1f}  {r['cpu_s'] + r['children_cpu_s']:7.1f}"
                f"  {r['children_cpu_s']:7.1f}  {r['tests']:5d}  {r['runs']:4d}"
            )
        if len(rows) > top:
            rest = rows[top:]
            more = f"({len(rest)} more)"
            lines.append(
                f"  {more:<{width}}  {sum(r['wall_s'] for r in rest):7.1f}"
                f"  {sum(r['cpu_s'] + r['children_cpu_s'] for r in rest):7.1f}"
            )
        for r in rows if runs_of else []:
            if r[name].startswith(runs_of):
                listed = True
                lines.append(f"\n  the runs of {r[name]}:")
                lines += [f"    {command}" for command in r.get("commands", [])]
        for r in rows if tests_of else []:
            if r[name].startswith(tests_of):
                listed = True
                lines.append(f"\n  the tests of {r[name]}, most CPU first:")
                lines.append(f"    {'CPU s':>7}  {'wall s':>7}  runs  test")
                costs = sorted(r.get("test_costs", []), key=lambda t: -t[2])
                lines += [f"    {c:7.1f}  {w:7.1f}  {n:4d}  {t}" for t, w, c, n in costs]
    if (runs_of or tests_of) and not listed:
        flag = f"--runs {runs_of}" if runs_of else f"--tests {tests_of}"
        lines.append(f"\nno module recorded matches {flag}")
    if len(totals) > 1:
        lines.append("\ntarget        wall      tests  runs  CPU")
        for target, wall, tests, runs, cpu in totals:
            minutes = _minutes(wall)
            lines.append(f"{target:<12}  {minutes:>8}  {tests:5d}  {runs:4d}  {_minutes(cpu)}")
    lines.append(
        "\n(CPU s: the test process's and its children's, ranks s: the children's alone: the "
        "runs, their agents and ranks; wall s: first setup to last teardown on its worker)"
    )
    return "\n".join(lines).lstrip("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make test-report", description=__doc__.split("\n")[0])
    parser.add_argument("targets", nargs="*", help="targets to show (default: every one recorded)")
    parser.add_argument("--top", type=int, default=10, help="modules shown per target (10)")
    parser.add_argument("--scopes", action="store_true", help="per xdist scope, not per module")
    parser.add_argument("--runs", default="", metavar="MODULE", help="list the runs it made")
    parser.add_argument("--tests", default="", metavar="MODULE", help="each test's cost")
    parser.add_argument("--schedule", action="store_true", help=f"rewrite {SCHEDULE.name}")
    args = parser.parse_args(argv)
    if args.schedule:
        print(f"wrote {write_schedule()}")
        return 0
    print(report(args.targets, args.top, args.scopes, args.runs, args.tests))
    return 0


if __name__ == "__main__":
    sys.exit(main())
