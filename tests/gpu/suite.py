"""`make test-gpu`: the CUDA suite in two passes, then a summary that fits on one screen.

    python tests/gpu/suite.py [pytest arguments]

First every GPU test that may share the GPU, side by side (`pytest -n auto` where
pytest-xdist is installed, capped at 8 workers unless PYTEST_XDIST_AUTO_NUM_WORKERS says
otherwise); then the ones marked `gpu_alone` (a real out-of-memory error, sized from the
memory free), one at a time. Without a CUDA device every test is skipped and says so.
Exit status: non-zero when a test failed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PASSES = [("shared", "gpu and not gpu_alone", True), ("alone", "gpu_alone", False)]


def _pytest(marker: str, parallel: bool, report: Path, extra: list[str]) -> int:
    command = [sys.executable, "-m", "pytest", "tests/gpu", "-m", marker, "-q", "-rs"]
    command += [f"--junitxml={report}", "-p", "no:cacheprovider"]
    if parallel and importlib.util.find_spec("xdist") is not None:
        command += ["-n", "auto"]
    env = {**os.environ, "PYTEST_XDIST_AUTO_NUM_WORKERS": os.environ.get(
        "PYTEST_XDIST_AUTO_NUM_WORKERS", str(min(8, os.cpu_count() or 1)))}  # fmt: skip
    return subprocess.run([*command, *extra], cwd=REPO, env=env).returncode


def _outcomes(report: Path) -> list[tuple[str, str, str, float]]:
    """(test function, outcome, first line of the reason, seconds) of every test case."""
    if not report.exists():
        return []
    found = []
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name", "?").split("[")[0]
        outcome, reason = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                reason = (node.get("message") or "").strip().splitlines()[0][:90] if (
                    node.get("message")) else ""  # fmt: skip
                break
        found.append((name, outcome, reason, float(case.get("time", 0.0))))
    return found


def _summary(results: list[tuple[str, str, str, float]], wall: float) -> str:
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    by_test: dict[str, list[tuple[str, str, str, float]]] = defaultdict(list)
    for result in results:
        by_test[result[0]].append(result)
    lines = [f"make test-gpu: {device}, torch {torch.__version__}, {wall:.0f} s"]
    for name, cases in by_test.items():
        counts = defaultdict(int)
        for _, outcome, _, _ in cases:
            counts[outcome] += 1
        mark = "FAIL" if counts.get("failed") or counts.get("error") else "ok  "
        if counts.get("skipped") == len(cases):
            mark = "skip"
        told = ", ".join(f"{n} {o}" for o, n in sorted(counts.items()))
        lines.append(f"  {mark} {name[:60]:60} {told} ({sum(c[3] for c in cases):.0f} s)")
        for _, outcome, reason, _ in cases:
            if outcome in ("failed", "error") and reason:
                lines.append(f"         {reason}")
    totals = defaultdict(int)
    for _, outcome, _, _ in results:
        totals[outcome] += 1
    lines.append("  " + ", ".join(f"{n} {o}" for o, n in sorted(totals.items())))
    return "\n".join(lines)


def main(extra: list[str]) -> int:
    started, status, results = time.time(), 0, []
    with tempfile.TemporaryDirectory() as tmp:
        for name, marker, parallel in PASSES:
            report = Path(tmp) / f"{name}.xml"
            code = _pytest(marker, parallel, report, extra)
            if code not in (0, 5):  # 5: nothing collected
                status = 1
            results += _outcomes(report)
    print("\n" + _summary(results, time.time() - started), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
