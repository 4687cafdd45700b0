"""Hydra's composition errors as runner's one-line problems.

Hydra reports an unknown group option, an unknown key or a malformed override
with several lines of its own (config search path, a hint about HYDRA_FULL_ERROR)
and exit code 1. runner reports them like every other bad value: the override,
what is wrong and what would be valid, exit code 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Union

from hydra.errors import (
    ConfigCompositionException,
    HydraException,
    MissingConfigException,
    OverrideParseException,
)

from runner.cli.conf_files import conf_dir, option_keys
from runner.errors import first_line
from runner.spec import RunSpec

GRAMMAR_DOCS = "https://hydra.cc/docs/advanced/override_grammar/basic/"


# Why a key belongs to one option of its group only, where that is not obvious.
WHY_ONLY = {
    "parallelism.tensor": (
        " (tensor parallelism splits layers into DTensor shards on FSDP2's device mesh; ddp "
        "keeps whole replicas and DeepSpeed's ZeRO flattens each parameter into partitions of "
        "its own, which cannot hold a layer split across ranks)"
    ),
    **{
        f"parallelism.{key}": (
            " (pipeline stages are sharded by FSDP2 on the mesh's data dimensions; ddp "
            "replicates the whole model on every rank and DeepSpeed's ZeRO partitions the whole "
            "model's flat parameters, so neither can hold one stage per group of ranks)"
        )
        for key in ("pipeline", "pipeline_schedule", "stages_per_rank", "pipeline_split", "pp_plan")
    },
    **{
        f"parallelism.{key}": (
            " (expert parallelism splits each layer's experts as DTensor shards on FSDP2's "
            "mesh, sharded further by FSDP2 over the other data ranks; ddp keeps whole "
            "replicas and DeepSpeed's ZeRO partitions flat parameters of its own)"
        )
        for key in ("expert", "ep_plan")
    },
    "parallelism.context": (
        " (context ranks hold parts of FSDP2's shards, which the gradients of their parts "
        "of the sequence are reduced into; ddp and ZeRO have no such mesh dimension)"
    ),
}


def composition_problems(
    exc: HydraException, overrides: list[str], conf_dir: str | None = None
) -> list[str]:
    """Hydra's error as runner's problems (one, or every override of a key the chosen group
    option lacks, where Hydra names the first): each a line naming the override, what is
    wrong with it and what is valid."""
    return composition_problem(exc, overrides, conf_dir).split("\n")


def composition_problem(
    exc: HydraException, overrides: list[str], conf_dir: str | None = None
) -> str:
    """One line naming the override, what is wrong with it and what is valid. `overrides`
    are the command line's, to show a group option the way it was given (`+recipe=...`);
    `conf_dir` lists a group's options where Hydra does not (a list: `logger=[a,b]`)."""
    missing = isinstance(exc, MissingConfigException) and exc.missing_cfg_file
    if missing and not exc.options and conf_dir and "/" in exc.missing_cfg_file:
        group = exc.missing_cfg_file.rpartition("/")[0]
        exc.options = [p.stem for p in (Path(conf_dir) / group).glob("*.yaml")]
    if missing and exc.options:
        group, _, option = exc.missing_cfg_file.rpartition("/")
        plus = "+" if any(o.startswith(f"+{group}=") for o in overrides) else ""
        where = re.match(r"In '([^']+)':", str(exc))
        asked_by = f" (asked for by {where[1]})" if where and where[1] != "config" else ""
        valid = ", ".join(sorted(exc.options))
        return f"{plus}{group}={option}: no such {group} option{asked_by}; valid: {valid}"
    if isinstance(exc, OverrideParseException):
        reason = first_line(exc.message)
        return f"{exc.override}: not a valid override ({reason}); see {GRAMMAR_DOCS}"
    key = getattr(exc.__cause__, "full_key", None)
    override = re.search(r"use \+(\S+)", str(exc))
    if isinstance(exc, ConfigCompositionException) and key and override:
        parent, _, leaf = key.rpartition(".")
        if parent in SWITCHED_SECTIONS and key in schema_keys(RunSpec):
            value = override[1].partition("=")[2]
            return (
                f"{override[1]}: {parent} is false here; give its options as a mapping: "
                f"{parent}={{{leaf}:{value}}}"
            )
        owners = _options_with(key)
        if owners:  # a key of another option of the group (parallelism=zero2 + a ddp key)
            return "\n".join(_not_of_chosen(override[1], key, owners, overrides))
        return f"{override[1]}: unknown key; {_suggestion(key)}"
    merging = re.match(r"Error merging override (\S+)", str(exc))
    reason = _type_mismatch(first_line(getattr(exc.__cause__, "msg", "") or ""))
    if merging and reason:  # a value of the wrong type for a typed key (Hydra's own, too)
        return f"{merging[1]}: {reason}"
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def _not_of_chosen(given: str, key: str, owners: list[str], overrides: list[str]) -> list[str]:
    """`given` names a key of other options of its group than the chosen one; so does every
    other override of a key only those options have (Hydra stops at the first): each one."""
    group = key.partition(".")[0]
    lines, seen = [], set()
    for override in [given, *overrides]:
        name = override.partition("=")[0]
        if name.startswith(("+", "~")) or name in seen:
            continue
        seen.add(name)
        theirs = _options_with(name)
        if name.startswith(f"{group}.") and theirs and set(theirs) <= set(owners):
            why = WHY_ONLY.get(name, "")
            lines.append(
                f"{override}: not a key of the chosen {group} option; "
                f"only of {group}={', '.join(theirs)}{why}"
            )
    return lines


TYPES = {
    "bool": "true or false",
    "boolean": "true or false",
    "int": "a whole number",
    "integer": "a whole number",
    "float": "a number",
}


def _type_mismatch(message: str) -> str | None:
    """OmegaConf's "Value 'x' is not a valid bool (type str)" as runner says it."""
    found = re.match(r"Value '.*' (?:is not a valid|could not be converted to) (\w+)", message)
    if found is None:
        return None
    kind = found[1].lower()
    return f"not a valid {kind}; valid: {TYPES.get(kind, kind)}"


SWITCHED_SECTIONS = {"compile"}  # `false`, or a mapping of options, in the YAML
RENAMED = {"tensorboard": "the logger group now: logger=none, logger=[tensorboard,csv], ..."}


def _suggestion(key: str) -> str:
    if key in RENAMED:
        return RENAMED[key]
    parent, _, leaf = key.rpartition(".")
    if key.startswith("hydra."):  # not the job's config: --cfg hydra shows Hydra's own
        group = f"hydra/{parent.split('.')[1]}=NAME " if parent.count(".") == 1 else ""
        return f"`runner {group}--cfg hydra --package {parent}` shows its keys"
    prefix = f"{parent}." if parent else ""
    siblings = [k[len(prefix) :] for k in schema_keys(RunSpec) if k.startswith(prefix)]
    siblings = [k for k in siblings if "." not in k]
    if parent and "." not in parent and (Path(conf_dir()) / parent).is_dir():
        siblings += option_keys(parent)  # a component's arguments, as its options name them
    close = difflib.get_close_matches(leaf, sorted(siblings), n=2, cutoff=0.8)
    if close:
        return "did you mean " + " or ".join(prefix + c for c in close) + "?"
    return "`runner --cfg job` shows every key"


def _options_with(key: str) -> list[str]:
    """The options of a config group (`parallelism`) whose schema has `key`, when some of
    them lack it (`parallelism.bucket_cap_mb` -> [ddp]); [] for any other key."""
    group, _, leaf = key.partition(".")
    if group not in {f.name for f in dataclasses.fields(RunSpec)} or not leaf or "." in leaf:
        return []
    options = list(_variants(typing.get_type_hints(RunSpec)[group]))
    owners: list[str] = []
    for option in options:
        if dataclasses.is_dataclass(option) and leaf in {
            f.name for f in dataclasses.fields(option)
        }:
            owners += [str(n) for n in typing.get_args(typing.get_type_hints(option).get("name"))]
    return owners if 0 < len(owners) < len(options) else []


def schema_keys(cls: type, prefix: str = "") -> set[str]:
    """Every dotted key the schema knows, over every option of every group."""
    keys: set[str] = set()
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        keys.add(key)
        for tp in _variants(hints[f.name]):
            if dataclasses.is_dataclass(tp):
                keys |= schema_keys(tp, key + ".")
    return keys


def _variants(tp: Any) -> tuple[Any, ...]:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def with_origins(problems: list[str], argv: list[str]) -> list[str]:
    """Problems the agent found in a component's arguments, each saying where a key not typed
    on the command line came from: the recipe given there (`+recipe=gpt_text`)."""
    recipes = [a.lstrip("+") for a in argv if a.lstrip("+").startswith("recipe=")]
    if not recipes:
        return problems
    typed = {a.lstrip("+~").partition("=")[0] for a in argv}
    said = []
    for problem in problems:
        key = re.match(r"([\w.]+): unexpected argument of ", problem)
        if key and key[1] not in typed:
            problem = problem.replace(": ", f" (set by +{recipes[-1]}): ", 1)
        said.append(problem)
    return said
