"""The module map on the design page, read from the source at build time: every module
under runner/, folder by folder, with the first line of its docstring. The marker line
`<!-- module-map -->` becomes the map; a module without a docstring fails the build."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

MARKER = "<!-- module-map -->"
PACKAGE = Path(__file__).resolve().parents[2] / "runner"


def _summary(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text()))
    if not doc:
        if path.name == "__init__.py":
            return ""
        raise ValueError(f"{path.relative_to(PACKAGE.parent)} has no docstring")
    return doc.strip().split("\n\n")[0].replace("\n", " ")


def module_map() -> str:
    out = []
    folders = [PACKAGE, *sorted(p for p in PACKAGE.rglob("*") if p.is_dir() and
                                (p / "__init__.py").exists())]  # fmt: skip
    for folder in folders:
        modules = sorted(folder.glob("*.py"))
        if not modules:
            continue
        name = folder.relative_to(PACKAGE.parent).as_posix()
        package_doc = _summary(folder / "__init__.py") if (folder / "__init__.py").exists() else ""
        out.extend([f"### `{name}/`", ""])
        if package_doc:
            out.extend([package_doc, ""])
        out.extend(["| module | what it holds |", "|---|---|"])
        for module in modules:
            if module.name == "__init__.py":
                continue
            summary = _summary(module).replace("|", "\\|")
            out.append(f"| `{module.stem}` | {summary} |")
        out.append("")
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, module_map())
