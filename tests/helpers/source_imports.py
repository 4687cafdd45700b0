"""runner's source read as text: its modules, the folder each sits in, and the imports of
runner code each makes (top level or lazy), for the tests of the layout (test_layers,
test_sizes). Nothing is imported."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

from tests.helpers.cli import REPO

PACKAGE = REPO / "runner"
SHARED = "shared"  # runner/*.py and runner/rundir/: what every process shares
SHARED_PACKAGES = {"rundir"}  # the run directory's files, read and written by every process


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


def is_module(name: str) -> bool:
    parts = name.split(".")[1:]
    target = PACKAGE.joinpath(*parts)
    return target.with_suffix(".py").is_file() or (target / "__init__.py").is_file()


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


@functools.cache  # the source does not change while the tests read it
def defined_names(module: str) -> frozenset[str]:
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
    return frozenset(names)


@functools.cache
def runner_imports(path: Path) -> tuple[tuple[str, bool, int], ...]:
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
                    if is_module(sub):
                        found.append((sub, lazy, child.lineno))
                    else:
                        assert alias.name in defined_names(base), (
                            f"{path}:{child.lineno}: {base} has no {alias.name}"
                        )
                        found.append((base, lazy, child.lineno))
            inner = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, lazy or inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return tuple(found)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
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
