"""The codebase holds its shape: the limits that keep runner/ readable, enforced.

Read from the source, like the layer test (tests/test_layers.py), over runner/ and
hydra_plugins/. A feature that needs more room makes room: split a module, move a helper
to the folder it belongs to, or give a long function the parts it is made of.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.cli import REPO
from tests.helpers.source_imports import MODULES, find_cycle, folder_of, runner_imports

ROOTS = (REPO / "runner", REPO / "hydra_plugins")
MAX_LOOSE_MODULES = 8  # runner/*.py besides __init__ and __main__: what every process shares
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60  # from `def` to its last line, docstring included
MAX_TRAINER_LINES = 300  # the loop stays as readable as nanoGPT's
MAX_CLI_MAIN_LINES = 340  # the parent's flow, with room for a command
MAX_RANK_FUNCTION_LINES = 50  # where a rank trains: runner/train/, engines/, models/
RANK_FOLDERS = ("train", "engines", "models")

SOURCES = sorted(p for root in ROOTS for p in root.rglob("*.py"))


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_few_loose_modules() -> None:
    loose = sorted(
        p.name
        for p in (REPO / "runner").glob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    )
    assert len(loose) <= MAX_LOOSE_MODULES, (
        f"{len(loose)} modules directly in runner/ (at most {MAX_LOOSE_MODULES}): {loose}; "
        "move one into the folder that uses it"
    )


def test_no_module_is_too_long() -> None:
    assert len(SOURCES) > 100
    long = {str(p.relative_to(REPO)): lines(p) for p in SOURCES if lines(p) > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_is_too_long() -> None:
    long = []
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                length = node.end_lineno - first + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({length})")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def function_lengths(path: Path) -> list[tuple[str, int]]:
    """(where, lines) of every function of `path`, decorators and docstring included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            where = f"{path.relative_to(REPO)}:{node.lineno} {node.name}"
            found.append((where, node.end_lineno - first + 1))
    return found


def test_a_rank_s_functions_leave_room() -> None:
    """Where a rank trains, functions stay shorter still: the next parallelism adds to them."""
    rank = [p for f in RANK_FOLDERS for p in sorted((REPO / "runner" / f).rglob("*.py"))]
    assert len(rank) > 40
    long = [
        f"{where} ({n})" for p in rank for where, n in function_lengths(p)
        if n > MAX_RANK_FUNCTION_LINES
    ]  # fmt: skip
    assert not long, f"functions over {MAX_RANK_FUNCTION_LINES} lines: {long}"


def test_the_cli_main_leaves_room() -> None:
    main = REPO / "runner" / "cli" / "main.py"
    assert lines(main) <= MAX_CLI_MAIN_LINES, (
        f"runner/cli/main.py has {lines(main)} lines (at most {MAX_CLI_MAIN_LINES}): move a "
        "command's own work into a module of runner/cli/"
    )


def test_the_trainer_stays_short() -> None:
    trainer = REPO / "runner" / "train" / "trainer.py"
    assert lines(trainer) <= MAX_TRAINER_LINES, (
        f"trainer.py has {lines(trainer)} lines (at most {MAX_TRAINER_LINES}): what the loop "
        "calls belongs in train/'s folders"
    )


def subfolder(module: str) -> str | None:
    """The folder inside a top-level folder that holds `module` (train.step, ...), if any."""
    parts = module.split(".")
    if len(parts) < 4 or folder_of(module) != parts[1]:
        return None
    package = REPO.joinpath(*parts[:3])
    return ".".join(parts[:3]) if (package / "__init__.py").is_file() else None


def test_no_two_subfolders_import_each_other() -> None:
    """Inside a folder (train/: build, checkpoints, guards, records, step), the subfolders
    form layers too: none imports, even lazily, one that imports it back."""
    edges: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        here = subfolder(name)
        if here is None:
            continue
        for target, _, _ in runner_imports(path):
            there = subfolder(target)
            if there is not None and there != here:
                edges.setdefault(here, set()).add(there)
    assert len(edges) >= 2, edges
    cycle = find_cycle(edges)
    assert cycle is None, f"subfolders that import each other: {' -> '.join(cycle or [])}"
