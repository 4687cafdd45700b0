"""The config reference page, generated at build time from conf/ and the schema.

conf/ holds the defaults and says what each key means (the YAML's comments); the schema
(runner.spec.schema and the modules it re-exports) says what is valid: the type, the
choices and the bounds. This hook
puts the two side by side in docs/config.md, in place of the marker line
`<!-- config-reference -->`, so the page cannot drift from either. A key that one has and
the other lacks fails the build (`make docs` is strict).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import yaml

from runner.cli.rerun import GROUPS  # the config groups, in conf/config.yaml's order
from runner.spec import parallelism_specs, schema, tracker_specs
from runner.spec.convert import config_key

MARKER = "<!-- config-reference -->"
ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"

# conf/ file -> the dataclass that checks it (None: a component, whose keys are arguments)
OPTION_CLASSES: dict[str, type | None] = {
    "parallelism/ddp": parallelism_specs.DDPSpec,
    "parallelism/zero1": parallelism_specs.ZeroSpec,
    "parallelism/zero2": parallelism_specs.ZeroSpec,
    "parallelism/zero3": parallelism_specs.Zero3Spec,
    "parallelism/fsdp": parallelism_specs.FSDPSpec,
    "parallelism/auto": parallelism_specs.AutoSpec,
    "launcher/elastic": schema.ElasticLauncherSpec,
    "launcher/ray": schema.RayLauncherSpec,
}
GROUP_CLASSES: dict[str, type | None] = {
    "precision": schema.PrecisionSpec,
    "sync_strategy": schema.SyncStrategySpec,
    "model": schema.ModelSpec,
    "data": schema.DataSpec,
    "loss": schema.LossSpec,
    "optimizer": schema.OptimizerSpec,
    "scheduler": schema.SchedulerSpec,
}
LOGGER_CLASSES = {
    "tensorboard": tracker_specs.TensorBoardTrackerSpec,
    "csv": tracker_specs.CsvTrackerSpec,
    "mlflow": tracker_specs.MlflowTrackerSpec,
    "wandb": tracker_specs.WandbTrackerSpec,
}
TOP_NESTED = {
    "checkpoint": schema.CheckpointSpec,
    "watchdog": schema.WatchdogSpec,
    "chaos": schema.ChaosSpec,
    "mfu": schema.MfuSpec,
    "profile": schema.ProfileSpec,
    "loss_spike": schema.LossSpikeSpec,
    "early_stop": schema.EarlyStopSpec,
    "init_from": schema.InitFromSpec,
    "sweep": schema.SweepSpec,
    "plan": schema.PlanSpec,
}


class ReferenceError(Exception):
    """conf/ and the schema disagree: a key one has and the other lacks."""


@dataclasses.dataclass
class Key:
    path: str
    default: Any
    comment: str = ""


def read_conf(path: Path) -> tuple[str, list[Key], list[tuple[int, str]]]:
    """A conf/ file: its header comment, its keys (dotted, with default and comment) in
    file order, and the `# --- section` lines (index into the keys, title)."""
    text = path.read_text()
    values = yaml.safe_load(text) or {}
    lines = text.splitlines()
    header = []
    for line in lines:
        if not line.startswith("#"):
            break
        header.append(line[1:])
    keys: list[Key] = []
    sections: list[tuple[int, str]] = []
    stack: list[tuple[int, str]] = []
    skip_indent: int | None = None
    for line in lines[len(header) :]:
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if stripped.startswith("# ---"):
            sections.append((len(keys), stripped.lstrip("#- ").strip()))
            continue
        if stripped.startswith("#"):
            if keys and indent > 0 and skip_indent is None:  # a comment continued
                keys[-1].comment += " " + stripped.lstrip("#").strip()
            continue
        match = re.match(r"^(\s*)([\w.]+):(.*)$", line)
        if not match:
            continue
        if skip_indent is not None and indent > skip_indent:
            continue
        skip_indent = None
        name, rest = match.group(2), match.group(3)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        dotted = ".".join([*(s for _, s in stack), name])
        value_part, _, comment = rest.partition(" #")
        if name in ("defaults", "hydra"):
            skip_indent = indent
            continue
        if not value_part.strip() and not _is_leaf(values, dotted):
            stack.append((indent, name))
            if comment.strip():
                keys.append(Key(dotted, _SECTION, comment.strip()))
            continue
        keys.append(Key(dotted, _lookup(values, dotted), comment.strip()))
    return _paragraph(header), keys, sections


def _paragraph(lines: list[str]) -> str:
    """A header comment as Markdown: its prose joined, its indented lines (examples) as
    code of their own."""
    out: list[str] = []
    for line in lines:
        if line.startswith("   "):
            out.append(f"\n\n    {line.strip()}\n\n")
        else:
            out.append(line.strip() + " ")
    return "".join(out).replace("\n\n\n\n", "\n\n").strip()


_SECTION = object()


def _lookup(values: dict, dotted: str) -> Any:
    node: Any = values
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _is_leaf(values: dict, dotted: str) -> bool:
    return not isinstance(_lookup(values, dotted), dict) or not _lookup(values, dotted)


def describe_type(field: dataclasses.Field) -> str:
    """What is valid, from the field's annotation and bounds: `int >= 1`, `auto | cpu`."""
    annotation = field.type if isinstance(field.type, str) else repr(field.type)
    parts = []
    for piece in _split_union(annotation):
        literal = re.fullmatch(r"Literal\[(.*)\]", piece)
        if literal:
            parts.extend(p.strip().strip("'\"") for p in literal.group(1).split(","))
        elif piece == "CompileSpec":
            parts.extend(["false", "true", "{mode, backend, per_block, fullgraph}"])
        elif piece in ("SyncStrategy", "Precision"):
            parts.extend(e.value for e in getattr(schema, piece))
        elif piece == "None":
            parts.append("null")
        elif piece.startswith("tuple["):
            parts.append("list")
        elif piece.startswith("dict["):
            parts.append("mapping")
        else:
            parts.append(piece)
    bounds = field.metadata
    text = " \\| ".join(
        f"`{p}`" if p not in ("int", "float", "str", "bool", "list", "mapping") else p
        for p in parts
    )
    limits = [f"{op} {bounds[key]}" for key, op in (("min", ">="), ("gt", ">"), ("max", "<="))
              if key in bounds]  # fmt: skip
    return text + (" (" + ", ".join(limits) + ")" if limits else "")


def _split_union(annotation: str) -> list[str]:
    pieces, depth, current = [], 0, ""
    for char in annotation:
        depth += char == "["
        depth -= char == "]"
        if char == "|" and depth == 0:
            pieces.append(current.strip())
            current = ""
        else:
            current += char
    pieces.append(current.strip())
    return [p for p in pieces if p]


def _fields(cls: type) -> dict[str, dataclasses.Field]:
    hints = {config_key(f.name): f for f in dataclasses.fields(cls)}
    own = {"target", "args"} if issubclass(cls, schema.Component) else set()
    return {k: v for k, v in hints.items() if k not in own}


def _render_default(value: Any) -> str:
    if value is _SECTION:
        return ""
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    text = text.removesuffix("\n...").removesuffix("...").strip()
    return f"`{text}`"


def _table(keys: list[Key], prefix: str, cls: type | None, where: str) -> list[str]:
    fields = _fields(cls) if cls is not None else {}
    rows = ["| key | default | valid | meaning |", "|---|---|---|---|"]
    for key in keys:
        top = key.path.split(".")[0]
        field = fields.get(top)
        component = cls is not None and issubclass(cls, schema.Component)
        if cls is not None and not component and key.path != "name" and field is None:
            raise ReferenceError(f"{where}: `{key.path}` is not a key of {cls.__name__}")
        valid = describe_type(field) if field is not None and key.path == top else ""
        rows.append(_row(prefix + key.path, key, valid))
    return rows


def _row(path: str, key: Key, valid: str) -> str:
    comment = key.comment.replace("|", "\\|")
    return f"| `{path}` | {_render_default(key.default)} | {valid} | {comment} |"


def top_level() -> list[str]:
    header, keys, sections = read_conf(CONF / "config.yaml")
    run_fields = _fields(schema.RunSpec)
    out: list[str] = []
    starts = dict(sections)
    seen: set[str] = set()
    rows: list[str] = []

    def flush() -> None:
        if rows:
            out.extend(["| key | default | valid | meaning |", "|---|---|---|---|", *rows, ""])
            rows.clear()

    for i, key in enumerate(keys):
        if i in starts:
            flush()
            out.extend([f"### {starts[i].capitalize()}", ""])
        top, _, rest = key.path.partition(".")
        if top not in run_fields:
            raise ReferenceError(f"conf/config.yaml: `{key.path}` is not a key of RunSpec")
        seen.add(top)
        if rest:
            nested = _fields(TOP_NESTED[top])
            if rest not in nested:
                raise ReferenceError(f"conf/config.yaml: `{key.path}` is not a key of the schema")
            field: dataclasses.Field | None = nested[rest]
        else:
            field = run_fields[top] if key.default is not _SECTION else None
        rows.append(_row(key.path, key, describe_type(field) if field is not None else ""))
    flush()
    missing = [n for n in run_fields if n not in seen and n not in GROUPS]
    if missing:
        raise ReferenceError(f"conf/config.yaml: no default for {', '.join(missing)}")
    return out


def group_section(group: str) -> list[str]:
    out = [f"### `{group}`", ""]
    options = sorted((CONF / group).glob("*.yaml"))
    out.append("Options: " + ", ".join(f"[`{p.stem}`](#{group}-{p.stem})" for p in options))
    out.append("")
    for path in options:
        header, keys, _ = read_conf(path)
        where = f"conf/{group}/{path.name}"
        out.extend([f"#### `{group}={path.stem}` {{ #{group}-{path.stem} }}", "", header, ""])
        if group == "logger":
            for name, cls in LOGGER_CLASSES.items():
                own = [k for k in keys if k.path.split(".")[0] == name and k.path != name]
                if own or (path.stem == name):
                    stripped = [Key(k.path.split(".", 1)[1], k.default, k.comment) for k in own]
                    if stripped:
                        out.extend(_table(stripped, f"logger.{name}.", cls, where))
                        out.append("")
            continue
        if group == "metrics":  # name -> component: shown as the YAML it is
            if keys:
                out.extend(["```yaml", _without_header(path), "```", ""])
            continue
        cls = OPTION_CLASSES.get(f"{group}/{path.stem}", GROUP_CLASSES.get(group))
        if keys:
            out.extend([*_table(keys, f"{group}.", cls, where), ""])
    return out


def _without_header(path: Path) -> str:
    lines = path.read_text().splitlines()
    while lines and lines[0].startswith("#"):
        lines.pop(0)
    return "\n".join(lines).strip()


def reference() -> str:
    out = ["## Scalars and nested keys (`conf/config.yaml`)", "", *top_level()]
    out.extend(["## Groups", ""])
    for group in GROUPS:
        out.extend(group_section(group))
    return "\n".join(out) + "\n"


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, reference())


if __name__ == "__main__":  # print the generated reference (for a look without mkdocs)
    print(reference())
