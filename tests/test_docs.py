"""The documentation: the config reference is generated from conf/ and the schema, and a key
one of them has and the other lacks fails the build; the README stays a front page. (The
site itself is built strictly by `make docs` in CI.)"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from runner.spec import schema
from tests.helpers.cli import REPO


def hook(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "docs" / "hooks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_config_reference_has_every_key_and_every_option() -> None:
    reference = hook("config_reference").reference()
    for field in dataclasses.fields(schema.RunSpec):
        if field.name in ("model", "data", "loss", "metrics", "optimizer", "scheduler",
                          "parallelism", "sync_strategy", "precision", "logger"):  # fmt: skip
            assert f"### `{field.name}`" in reference, field.name
        else:
            assert f"| `{field.name}" in reference, field.name
    for path in (REPO / "conf").glob("*/*.yaml"):
        if path.parent.name not in ("hydra", "recipe"):
            assert f"`{path.parent.name}={path.stem}`" in reference, path
    # what is valid comes from the schema, the default and the meaning from conf/
    assert "| `nproc` | `2` | int \\| `auto` (>= 1) | ranks on this node" in reference
    assert "| `parallelism.offload_param` | `none` | `none` \\| `cpu` |" in reference


def test_a_conf_key_the_schema_lacks_fails_the_reference(tmp_path: Path) -> None:
    config_reference = hook("config_reference")
    bogus = tmp_path / "fsdp.yaml"
    bogus.write_text("# FSDP with a typo\nname: fsdp\nreshard_after_froward: true  # typo\n")
    _, keys, _ = config_reference.read_conf(bogus)
    with pytest.raises(config_reference.ReferenceError, match="reshard_after_froward"):
        config_reference._table(keys, "parallelism.", schema.FSDPSpec, "fsdp.yaml")


def test_the_readme_is_a_front_page_whose_links_resolve() -> None:
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    links = re.findall(r"\]\(([^)#:]+\.md)\)", readme)
    assert len(links) >= 10, links
    for link in links:
        assert (REPO / link).is_file(), link
    nav = (REPO / "mkdocs.yml").read_text()
    for page in (REPO / "docs").glob("*.md"):
        assert f": {page.name}" in nav, f"{page.name} is not in mkdocs.yml's nav"


def test_every_runner_module_is_on_the_design_page() -> None:
    modules = hook("module_map").module_map()
    for path in (REPO / "runner").rglob("*.py"):
        if path.name != "__init__.py":
            assert f"| `{path.stem}` |" in modules, path


def test_the_composition_table_is_what_the_checks_refuse() -> None:
    """docs/parallelism.md's table of what composes, generated from the mesh's declared
    dimensions: a cell reads "not yet" exactly where a grid with both dimensions at 2 is
    refused, naming both keys; and every dimension of the table is one of the mesh's."""
    from runner.spec.mesh import DIMENSIONS, Layout, composition_problems

    table = hook("composition_table")
    lines = table.composition_table().splitlines()
    page = (REPO / "docs" / "parallelism.md").read_text()
    assert table.MARKER in page
    headings = {d.name: d.heading for d in DIMENSIONS}
    for row in table.ROWS:
        cells = next(line for line in lines if line.startswith(f"| {headings[row]} |"))
        for column, cell in zip(table.COLUMNS, cells.split("|")[2:], strict=False):
            if row == column:
                continue
            sizes = {n: 2 if n in (row, column) else 1 for n in headings if n != "shard"}
            refused = composition_problems(Layout(**sizes))
            assert (cell.strip() == "not yet") == bool(refused), (row, column, refused)
            for problem in refused:
                assert f"parallelism.{row}=2" in problem or f"parallelism.{column}=2" in problem
                assert problem.endswith(" yet"), problem
