"""docs/parallelism.md's table of what composes with what, generated at build time from the
mesh's dimensions as runner declares them (runner.spec.mesh.DIMENSIONS): a pair one of them
does not compose with yet reads "not yet", and is what the checks refuse before launch. The
table goes in place of the marker line `<!-- composition-table -->`.
"""

from __future__ import annotations

from typing import Any

from runner.spec.mesh import CONTEXT, DIMENSIONS, EXPERT, PIPELINE, REPLICATE, SHARD, TENSOR
from runner.spec.mesh import composes as _composes

MARKER = "<!-- composition-table -->"
ROWS = (SHARD, TENSOR, PIPELINE, CONTEXT, EXPERT)  # the page's order, not the mesh's
COLUMNS = (REPLICATE, TENSOR, PIPELINE, CONTEXT, EXPERT)


def composition_table() -> str:
    """The table, as markdown: each row a dimension, each column another and compile."""
    by_name = {d.name: d for d in DIMENSIONS}
    head = ["", *(by_name[c].heading for c in COLUMNS), "`compile`"]
    lines = [_row(head), "|" + "---|" * len(head)]
    for row in ROWS:
        cells = [by_name[row].heading]
        for column in COLUMNS:
            cells.append("" if row == column else "yes" if _composes(row, column) else "not yet")
        cells.append(by_name[row].compiles)
        lines.append(_row(cells))
    return "\n".join(lines)


def _row(cells: list[str]) -> str:
    return "|" + "|".join(f" {cell} " if cell else " " for cell in cells) + "|"


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, composition_table())
