"""The torch releases runner supports: the floor pyproject.toml declares is the one the parent
checks, and an older torch stops the `runner` command with one line before anything starts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from runner.cli import torch_release
from tests.helpers.cli import HANG, REPO, child_env


def test_pyproject_declares_the_floor_the_parent_checks():
    pyproject = (REPO / "pyproject.toml").read_text()
    torch_spec = re.search(r'"torch>=(\d+)\.(\d+)[^"]*"', pyproject)
    vision_spec = re.search(r'"torchvision>=0\.(\d+)[^"]*"', pyproject)
    assert torch_spec and vision_spec, "pyproject.toml declares torch and torchvision floors"
    assert (int(torch_spec[1]), int(torch_spec[2])) == torch_release.FLOOR
    # torchvision 0.N pairs with torch 2.(N - 15)
    assert int(vision_spec[1]) - 15 == torch_release.FLOOR[1]
    floor = ".".join(map(str, torch_release.FLOOR))
    makefile = (REPO / "Makefile").read_text()
    installed = re.search(r"FLOOR_TORCH\s*:=\s*(\S+)", makefile)
    assert installed and installed[1].startswith(f"{floor}."), "make test-floor installs it"


def test_the_newest_tested_release_is_the_one_make_test_installs():
    """The range's other end: constraints.txt pins the torch `make test` runs on, and the
    message an old torch gets names it as the newest tested."""
    pinned = re.search(r"^torch==(\d+)\.(\d+)\.", (REPO / "constraints.txt").read_text(), re.M)
    assert pinned, "constraints.txt pins torch"
    assert (int(pinned[1]), int(pinned[2])) == torch_release.NEWEST_TESTED


@pytest.mark.parametrize(
    "installed", ["2.11.0", "2.11.0+cu130", "2.11.0a0+git1f6f5ee", "2.14.1", "3.0.0"]
)
def test_releases_from_the_floor_on_are_accepted(installed):
    assert torch_release.problem(installed) is None


@pytest.mark.parametrize("installed", ["2.10.0+cu128", "2.4.1", "1.13.1"])
def test_an_older_release_is_named_with_the_supported_range(installed):
    line = torch_release.problem(installed)
    assert line is not None and "\n" not in line
    assert f"torch {installed} is installed" in line
    assert "supports torch 2.11 and newer" in line


def test_no_torch_at_all_is_said_so():
    assert "torch is not installed" in torch_release.problem(None)


@pytest.mark.slow
def test_runner_exits_at_startup_below_the_floor(tmp_path: Path):
    """A real `runner` whose environment reports torch 2.9.1 (a distribution's metadata first
    on the path, as an old image's site-packages would): one line, exit 2, no run directory."""
    shadow = tmp_path / "site"
    meta = shadow / "torch-2.9.1.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.9.1\n")
    env = child_env()
    env["PYTHONPATH"] = f"{shadow}:{env['PYTHONPATH']}"
    done = subprocess.run(
        [sys.executable, "-m", "runner.cli.entry", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    newest = ".".join(map(str, torch_release.NEWEST_TESTED))
    assert lines == [
        "runner: torch 2.9.1 is installed; runner supports torch 2.11 and newer (tested 2.11 "
        f"to {newest}): install a newer one, e.g. pip install 'torch>=2.11'"
    ]
    assert not (tmp_path / "run").exists()
