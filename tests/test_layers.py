"""The layout keeps the flow of a run visible: one folder per process, imports only downward.

Read from the source (no import needed), so a new module is covered the day it lands:
- at module level, a folder imports only the folders below it that it may use (MAY_IMPORT);
- a lazy import (inside a function) follows the same rules, apart from LAZY_EXCEPTIONS;
- no import cycle inside a folder, lazy imports included;
- the parent's folders (cli/, spec/) never load torch, torchvision, deepspeed or sklearn.

Why a test and not import-linter contracts: one table (MAY_IMPORT) says the whole rule, where
import-linter needs a layers contract plus a forbidden contract per folder that may not reach
a lower one (cli/ skips launch/, train/, engines/, models/ and data/); the lazy exceptions are
named with their reasons; and the last rule is about what a fresh interpreter loads, which no
static contract can check. It reads the source in a fraction of a second, with no dependency.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys

import pytest
import tomllib

from tests.helpers.cli import REPO, child_env
from tests.helpers.source_imports import (
    MODULES,
    SHARED,
    defined_names,
    find_cycle,
    folder_of,
    is_module,
    runner_imports,
)

# What each folder may import (besides itself), top of the run's flow first. spec/ is read by
# every process, so it sits low; the parent (cli/) never imports the training side (train/,
# engines/, models/, data/), the agent (launch/) only data/ and models/ (its pre-flight check
# asks the data what it reports and looks for the model's blocks on the meta device), and
# nothing imports cli/ or launch/.
MAY_IMPORT: dict[str, set[str]] = {
    "cli": {"trackers", "sweeps", "spec", SHARED},
    # launch's pre-launch check builds the optimizer and schedule the engines will build
    "launch": {"engines", "models", "data", "spec", SHARED},
    "export": {"models", "data", "spec", SHARED},  # `runner export`: a process of its own
    # parallelism=auto's planner, a process of its own (the parent reads its plan): it
    # resolves each layout as the parent would and checks its model as the agent would
    "layouts": {"launch", "train", "engines", "models", "data", "spec", SHARED},
    "train": {"engines", "models", "data", "trackers", "sweeps", "spec", SHARED},
    "engines": {"models", "data", "spec", SHARED},
    "models": {"data", "spec", SHARED},
    "data": {"spec", SHARED},
    # the trackers: rank 0 logs to them, the parent ends what rank 0 could not
    "trackers": {"spec", SHARED},
    # a sweep's core: its jobs, launchers' shared parts, tables, resume and study (run by the
    # sweep's process through cli/ and hydra_plugins/; rank 0 reports to its study: train/)
    "sweeps": {"trackers", "spec", SHARED},
    "spec": {SHARED},
    SHARED: set(),
}

# Lazy imports that reach up, each for a reason. The resume check (parent) compares a
# checkpoint with the configured model, built in-process only when torch is loaded already
# (else in a `python -m runner.models.shapes` child).
LAZY_EXCEPTIONS: dict[str, set[str]] = {
    "runner.spec.resume_check": {"runner.models.shapes"},
    # `runner export` runs no training: the console script hands it over before anything else
    "runner.cli.entry": {"runner.export.command"},
    # launcher=ray: Ray runs the rank's stages in its own worker processes, handed the entry
    "runner.launch.ray_launch": {"runner.train.ray_worker"},
}

HEAVY = ("torch", "torchvision", "deepspeed", "sklearn")


def test_every_import_of_runner_code_resolves() -> None:
    """`make test` imports neither the benchmarks nor every lazy path: read them instead."""
    for path in [*MODULES.values(), *sorted((REPO / "benchmarks").glob("*.py"))]:
        for target, _, line in runner_imports(path):
            assert is_module(target), f"{path}:{line}: {target} is not a runner module"


def test_entry_points_name_real_modules() -> None:
    """The names processes and configs start runner code by: `python -m` commands (code,
    Makefile, README, docs), console scripts (module:function) and `_target_`s in conf/
    (module.attribute)."""
    texts = [
        *MODULES.values(),
        *REPO.glob("benchmarks/*.py"),
        *REPO.glob("tests/**/*.py"),
        REPO / "Makefile",
        REPO / "README.md",
        *REPO.glob("docs/*.md"),
    ]
    commands = {
        (path.name, name)
        for path in texts
        for name in re.findall(r"""-m["', ]+(runner(?:\.\w+)*)""", path.read_text())
    }
    assert len(commands) >= 6, commands
    for where, name in sorted(commands):
        assert is_module(name), f"{where}: python -m {name}: no such module"

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    targets = [target.split(":") for target in scripts.values()]
    for path in REPO.glob("conf/**/*.yaml"):
        found = re.findall(r"_target_:\s*(runner\.[\w.]+)", path.read_text())
        targets += [name.rsplit(".", 1) for name in found]
    assert len(targets) >= 3, targets
    for module, attr in targets:
        assert is_module(module) and attr in defined_names(module), f"no {module}.{attr}"


def test_every_folder_has_a_place_in_the_layers() -> None:
    folders = {folder_of(name) for name in MODULES}
    assert folders == set(MAY_IMPORT), f"add the new folder to MAY_IMPORT: {folders}"


def test_imports_only_go_down_the_layers() -> None:
    problems = []
    for name, path in MODULES.items():
        here = folder_of(name)
        for target, lazy, line in runner_imports(path):
            there = folder_of(target)
            if there == here or there in MAY_IMPORT[here]:
                continue
            if lazy and target in LAZY_EXCEPTIONS.get(name, set()):
                continue
            kind = "lazily " if lazy else ""
            problems.append(f"{path.relative_to(REPO)}:{line}: {here}/ {kind}imports {target}")
    assert not problems, "imports going up the layers:\n" + "\n".join(problems)


def test_cycle_finder_finds_afind_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize("folder", sorted(MAY_IMPORT))
def test_no_import_cycle_inside_a_folder(folder: str) -> None:
    graph = {
        name: {t for t, _, _ in runner_imports(path) if folder_of(t) == folder and t != name}
        for name, path in MODULES.items()
        if folder_of(name) == folder
    }
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle in {folder}/: {' -> '.join(cycle or [])}"


@pytest.mark.slow
def test_parent_modules_never_load_torch() -> None:
    """Import every module under runner/cli/ and runner/spec/ in a fresh interpreter, one at a
    time, and name any that brings in a heavy package."""
    parent = sorted(n for n in MODULES if folder_of(n) in ("cli", "spec"))
    assert "runner.cli.main" in parent and "runner.spec.resolve" in parent
    code = f"""
import importlib, json, sys
heavy = {HEAVY!r}
loaded = {{}}
for name in {parent!r}:
    importlib.import_module(name)
    loaded[name] = [m for m in heavy if m in sys.modules]
print(json.dumps(loaded))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=child_env()
    )
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.splitlines()[-1])
    first = next(((n, m) for n, m in loaded.items() if m), None)
    assert first is None, f"importing {first[0]} loads {first[1]}"  # type: ignore[index]


def test_no_test_module_imports_another() -> None:
    """What tests share lives in tests/helpers/ (or tests/conftest.py), so that a test module
    can be read, moved or deleted on its own."""
    problems = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name.startswith("tests.") and name.rsplit(".", 1)[-1].startswith("test_"):
                    problems.append(f"{path.relative_to(REPO)}:{node.lineno}: imports {name}")
    assert not problems, "\n".join(problems)
