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
from pathlib import Path

import pytest
import tomllib

from tests.helpers.cli import REPO, child_env

PACKAGE = REPO / "runner"
SHARED = "shared"  # runner/*.py and runner/rundir/: what every process shares
SHARED_PACKAGES = {"rundir"}  # the run directory's files, read and written by every process

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
    "train": {"engines", "models", "data", "trackers", "sweeps", "spec", SHARED},
    "engines": {"models", "data", "spec", SHARED},
    "models": {"data", "spec", SHARED},
    "data": {"spec", SHARED},
    # the trackers: rank 0 logs to them, the parent ends what rank 0 could not
    "trackers": {"spec", SHARED},
    # a sweep's study: kept by the sweep's process (cli/), reported to by rank 0 (train/)
    "sweeps": {SHARED},
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


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def folder_of(module: str) -> str:
    parts = module.split(".")
    is_package = (PACKAGE.joinpath(*parts[1:]) / "__init__.py").is_file()
    if len(parts) == 1 or (len(parts) == 2 and not is_package) or parts[1] in SHARED_PACKAGES:
        return SHARED
    return parts[1]


def _is_module(name: str) -> bool:
    parts = name.split(".")[1:]
    target = PACKAGE.joinpath(*parts)
    return target.with_suffix(".py").is_file() or (target / "__init__.py").is_file()


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def defined_names(module: str) -> set[str]:
    """The names a runner module defines or imports at its top level."""
    parts = module.split(".")[1:]
    target = PACKAGE.joinpath(*parts)
    path = target / "__init__.py" if target.is_dir() else target.with_suffix(".py")
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return names


def runner_imports(path: Path) -> list[tuple[str, bool, int]]:
    """(imported runner module, lazy?, line) for every import of runner code that runs."""
    found: list[tuple[str, bool, int]] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking_only(child):
                continue  # annotations only; never executed
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == "runner":
                        found.append((alias.name, lazy, child.lineno))
            elif isinstance(child, ast.ImportFrom):
                assert child.level == 0, f"{path}:{child.lineno}: use absolute imports"
                base = child.module or ""
                if base.split(".")[0] != "runner":
                    continue
                for alias in child.names:  # `from runner.x import y`: y may be a module
                    sub = f"{base}.{alias.name}"
                    if _is_module(sub):
                        found.append((sub, lazy, child.lineno))
                    else:
                        assert alias.name in defined_names(base), (
                            f"{path}:{child.lineno}: {base} has no {alias.name}"
                        )
                        found.append((base, lazy, child.lineno))
            inner = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, lazy or inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_import_of_runner_code_resolves() -> None:
    """`make test` imports neither the benchmarks nor every lazy path: read them instead."""
    for path in [*MODULES.values(), *sorted((REPO / "benchmarks").glob("*.py"))]:
        for target, _, line in runner_imports(path):
            assert _is_module(target), f"{path}:{line}: {target} is not a runner module"


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
        assert _is_module(name), f"{where}: python -m {name}: no such module"

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    targets = [target.split(":") for target in scripts.values()]
    for path in REPO.glob("conf/**/*.yaml"):
        found = re.findall(r"_target_:\s*(runner\.[\w.]+)", path.read_text())
        targets += [name.rsplit(".", 1) for name in found]
    assert len(targets) >= 3, targets
    for module, attr in targets:
        assert _is_module(module) and attr in defined_names(module), f"no {module}.{attr}"


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


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (a list of nodes, first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := walk(node)):
            return found
    return None


def test_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


@pytest.mark.parametrize("folder", sorted(MAY_IMPORT))
def test_no_import_cycle_inside_a_folder(folder: str) -> None:
    graph = {
        name: {t for t, _, _ in runner_imports(path) if folder_of(t) == folder and t != name}
        for name, path in MODULES.items()
        if folder_of(name) == folder
    }
    cycle = _cycle(graph)
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
