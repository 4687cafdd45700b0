"""A parallelism is one room: its files name no other parallelism, and the model, the step
and the loop name none. runner.train.build.parallelize is where they meet (it decides), and
runner.train.step.microbatching hands a step to the stages' schedule when there are stages.

A model family is one room too: its declaration (runner.models.families) and its model's
code name it, and no other file of runner does (by an identifier, or by a `_target_`-like
dotted name in a string); everything else asks a model's family. runner.data is not held to
it: a tokenizer or an image decoder of the same library is data's, not the model's.

Read from the source: the identifiers of the code (names, attributes, imports, definitions,
arguments), not its docstrings or comments, which may say what a file works beside.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.cli import REPO

# each parallelism's files, and the names that say it (a substring of an identifier, or,
# for the short common ones, the whole identifier)
ROOMS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    # name: (files, substrings, whole identifiers)
    "ddp": (("runner/engines/ddp.py", "runner/engines/shared_memory.py"), ("ddp",), ()),
    "deepspeed": (
        ("runner/engines/deepspeed.py", "runner/engines/deepspeed_ops.py"),
        ("deepspeed",),
        (),
    ),
    "fsdp": (("runner/engines/fsdp.py",), ("fsdp", "fully_shard"), ()),
    "pipeline": (
        (
            "runner/engines/pipeline.py",
            "runner/models/pipeline_stages.py",
            "runner/train/step/pipelined.py",
        ),
        ("pipeline", "pipelined", "staged"),
        (),
    ),
    "context": (
        ("runner/models/context_split.py",),
        ("context_split", "contextsplit", "apply_context", "context_mesh"),
        ("context",),
    ),
    "float8": (("runner/engines/float8.py",), ("float8",), ()),
    "tensor": (
        ("runner/models/tensor_plans.py",),
        ("tensor_plan", "tp_plan", "parallelize_module", "colwise", "rowwise"),
        (),
    ),
    "expert": (
        (
            "runner/models/expert_split.py",
            "runner/models/expert_exchange.py",
            "runner/models/expert_dispatch.py",
        ),
        ("expert_split", "split_experts", "apply_experts", "ep_plan", "expert_dispatch"),
        (),
    ),
}

# Where two rooms meet today, and why; each is to go (the open issue on declaring a
# parallelism once), so the list only shrinks: a meeting not found any more fails
# test_every_known_meeting_is_still_there until it is struck off here.
KNOWN_MEETINGS: dict[tuple[str, str], set[str]] = {}

# the names another library or a documented config key gives a meeting of two (torchao's
# float8 weights gathered by FSDP, `precision.fsdp_float8_all_gather`)
SPOKEN_FOR = {
    "runner/engines/float8.py": {
        "fsdp_float8_all_gather",
        "enable_fsdp_float8_all_gather",
        "precompute_float8_dynamic_scale_for_fsdp",
    },
}

# what every parallelism passes through: none of their names here
SHARED = (
    "runner/models/gpt.py",
    "runner/engines/base.py",
    "runner/train/trainer.py",
    "runner/train/evaluation.py",
    "runner/train/step/loss_pass.py",
    "runner/train/step/batch_parts.py",
    "runner/train/step/device_feed.py",
)


def identifiers(path: Path) -> set[str]:
    """The names a file's code uses or defines, imported modules' dotted paths split."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.update(node.name.split("."))
            if node.asname:
                names.add(node.asname)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.update(node.module.split("."))
    return names


def named(path: Path, room: str) -> list[str]:
    """The identifiers of `path` that name parallelism `room`."""
    _, parts, wholes = ROOMS[room]
    spoken_for = SPOKEN_FOR.get(str(path.relative_to(REPO)) if path.is_relative_to(REPO) else "")
    return sorted(
        name
        for name in identifiers(path) - (spoken_for or set())
        if name in wholes or any(part in name.lower() for part in parts)
    )


def test_every_room_file_exists() -> None:
    for files, _, _ in ROOMS.values():
        for file in files:
            assert (REPO / file).is_file(), file
    for file in SHARED:
        assert (REPO / file).is_file(), file


def meetings() -> dict[tuple[str, str], set[str]]:
    """(a room's file, another room): the names it says of it."""
    found = {}
    for room, (files, _, _) in ROOMS.items():
        for file in files:
            for other in ROOMS:
                if other != room and named(REPO / file, other):
                    found[(file, other)] = set(named(REPO / file, other))
    return found


def test_no_parallelism_names_another() -> None:
    unknown = [
        f"{file} names {other}: {sorted(names - KNOWN_MEETINGS.get((file, other), set()))}"
        for (file, other), names in meetings().items()
        if names - KNOWN_MEETINGS.get((file, other), set())
    ]
    assert not unknown, "\n".join(unknown)


def test_every_known_meeting_is_still_there() -> None:
    found = meetings()
    gone = {key: names - found.get(key, set()) for key, names in KNOWN_MEETINGS.items()}
    assert not any(gone.values()), f"strike these off KNOWN_MEETINGS: {gone}"


def test_the_shared_path_names_no_parallelism() -> None:
    found = [
        f"{file} names {room}: {named(REPO / file, room)}"
        for file in SHARED
        for room in ROOMS
        if named(REPO / file, room)
    ]
    assert not found, "\n".join(found)


def test_the_check_sees_a_name(tmp_path: Path) -> None:
    """The reading finds a parallelism's name in code, and not in a docstring."""
    code = tmp_path / "probe.py"
    code.write_text('"""Works beside the pipeline."""\nfrom runner.engines.float8 import x\n')
    assert named(code, "float8") == ["float8"]
    assert named(code, "pipeline") == []


# each model family's files, and the names that say it (substrings of an identifier, or of
# a dotted name in a string)
FAMILIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "gpt": (
        (
            "runner/models/gpt.py",
            "runner/models/gpt_moe.py",  # built on it
            "runner/models/families/gpt.py",
            "runner/models/families/gpt_moe.py",
        ),
        ("gpt",),
    ),
    "gpt_moe": (
        ("runner/models/gpt_moe.py", "runner/models/families/gpt_moe.py"),
        ("gpt_moe", "gptmoe"),
    ),
    "hugging_face": (
        (
            "runner/models/families/hugging_face.py",
            "runner/models/families/hugging_face_export.py",
            "runner/models/stacked_experts.py",  # its checkpoints' experts, one tensor each
        ),
        ("hugging_face", "transformers"),
    ),
    "vision": (
        ("runner/models/families/vision.py", "runner/models/builders.py"),  # runner's resnets
        ("resnet", "torchvision", "timm"),
    ),
}


def dotted_strings(path: Path) -> set[str]:
    """The string constants of a file that read as a dotted name (a `_target_`, a module)."""
    import re

    return {
        node.value
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+", node.value)
    }


def family_named(path: Path, family: str) -> list[str]:
    _, parts = FAMILIES[family]
    said = identifiers(path) | dotted_strings(path)
    return sorted(name for name in said if any(part in name.lower() for part in parts))


def test_no_file_outside_a_family_names_it() -> None:
    found = [
        f"{path.relative_to(REPO)} names {family}: {family_named(path, family)}"
        for path in sorted((REPO / "runner").rglob("*.py"))
        if not path.is_relative_to(REPO / "runner" / "data")
        for family, (files, _) in FAMILIES.items()
        if str(path.relative_to(REPO)) not in files and family_named(path, family)
    ]
    assert not found, "\n".join(found)


def test_every_family_is_found_and_its_files_exist() -> None:
    from runner.models.families import families

    assert [f.name for f in families()] == ["gpt_moe", "gpt", "hugging_face", "vision", "generic"]
    for files, _ in FAMILIES.values():
        for file in files:
            assert (REPO / file).is_file(), file


def test_the_family_check_sees_a_target_string(tmp_path: Path) -> None:
    code = tmp_path / "probe.py"
    code.write_text('"""Beside runner.models.gpt."""\nchecks = t.startswith("runner.models.gpt")\n')
    assert family_named(code, "gpt") == ["runner.models.gpt"]
    assert family_named(code, "vision") == []
