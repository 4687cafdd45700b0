"""The benchmark pages, taken at build time from benchmarks/results/ (written by
`make bench`): each results file becomes a page under benchmarks/, and the marker line
`<!-- benchmark-results -->` becomes a list of them. No figure is ever copied by hand."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

MARKER = "<!-- benchmark-results -->"
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def _suites() -> list[Path]:
    return sorted(p for p in RESULTS.glob("*.md") if p.stem != "latest")


def _title(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
    return path.stem


def on_files(files: Files, config: Any) -> Files:
    for path in _suites():
        content = (
            f"# {path.stem}\n\nWritten by `make bench` (`benchmarks/results/{path.name}`).\n\n"
        )
        content += path.read_text()
        files.append(File.generated(config, f"benchmarks/{path.name}", content=content))
    return files


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if MARKER not in markdown:
        return markdown
    here = Path(page.file.src_uri).parent
    rows = []
    for path in _suites():
        link = Path("benchmarks", path.name)
        relative = link if here == Path(".") else Path("..") / link
        rows.append(f"- [{path.stem}]({relative.as_posix()}): {_title(path)}")
    return markdown.replace(MARKER, "\n".join(rows))
