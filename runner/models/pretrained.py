"""Starting from pretrained weights: `init_from=PATH`.

PATH is a model.pt, a .safetensors file, a directory of sharded .safetensors files with
their index, or a local Hugging Face model directory (runner.models.tensor_files; nothing
is ever downloaded). The file's names are mapped to the model's (`init_from.strip_prefix`
is taken off the names that start with it, then `init_from.prefix` is put before each),
and matched against the model's parameters and persistent buffers:

- missing: a model tensor the file does not hold (the tensors a model ties together, such
  as an embedding and its output head, count as one);
- unexpected: a file tensor the model does not have;
- a shape that differs is always an error.

With `init_from.strict` (the default) missing or unexpected names are an error, reported
before any rank starts; without it they are logged, and missing tensors keep the seeded
initialisation. Each tensor is copied in with a conversion to the model's dtype, one at a
time: a rank that builds the whole model reads every tensor, one that holds only shards
(fsdp and zero3 with meta_init) reads only its own part of each (runner.train.build.sharded_init).
A run that restores a checkpoint (`resume`) loads it over these weights: resume wins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from runner.models.tensor_files import TensorFile
from runner.spec.schema import InitFromSpec

SHOWN = 5  # names listed in a mismatch message
WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")  # names runner's wrappers add


def unwrapped_name(name: str) -> str:
    """A tensor's name in the plain model: without the parts activation checkpointing and
    compile add to a path."""
    for wrapper in WRAPPERS:
        name = name.replace(wrapper, "")
    return name


@dataclass
class Matching:
    """Which file tensor fills each model tensor, and what does not match."""

    sources: dict[str, str] = field(default_factory=dict)  # model name -> file name
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)  # "name: file (..), model (..)"

    def problems(self, spec: InitFromSpec) -> list[str]:
        """What stops the run: shape mismatches, and under `strict` any missing or
        unexpected name, each kind in one line naming the first few."""
        found = [_listing(f"init_from.path={spec.path}: shapes differ", self.mismatched)]
        if spec.strict:
            hint = " (init_from.strict=false loads what matches; init_from.prefix and "
            hint += "init_from.strip_prefix map the file's names)"
            found.append(_listing(f"init_from.path={spec.path}: missing", self.missing, hint))
            found.append(_listing(f"init_from.path={spec.path}: unexpected", self.unexpected))
        return [line for line in found if line]

    def summary(self) -> str:
        line = f"{len(set(self.sources.values()))} tensors"
        if self.missing:
            line += f"; {_listing('missing (seeded instead)', self.missing)}"
        if self.unexpected:
            line += f"; {_listing('unexpected (ignored)', self.unexpected)}"
        return line


def _listing(what: str, names: list[str], hint: str = "") -> str:
    if not names:
        return ""
    more = f", and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return f"{what}: {len(names)} ({', '.join(names[:SHOWN])}{more}){hint}"


def model_name(file_name: str, spec: InitFromSpec) -> str:
    """A file tensor's name in the model."""
    if spec.strip_prefix and file_name.startswith(spec.strip_prefix):
        file_name = file_name[len(spec.strip_prefix) :]
    return spec.prefix + file_name


def loaded_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """What init_from fills: the module's state_dict names (parameters and persistent
    buffers; tied tensors under each of their names), as the module holds them."""
    return dict(module.state_dict(keep_vars=True))


def match(
    file: TensorFile,
    tensors: dict[str, torch.Tensor],
    spec: InitFromSpec,
    module: nn.Module | None = None,
) -> Matching:
    """Pair the model's tensors with the file's (shapes: the model's whole ones; a sharded
    tensor gives its global shape). With the `module` (a Hugging Face one), a tensor the
    file holds in parts, one per expert, is matched with its stacked source
    (runner.models.stacked_experts)."""
    found = Matching()
    by_model = {model_name(n, spec): n for n in file.names()}
    filled: dict[int, str] = {}  # id of a tensor the file fills -> its file name
    differ = set()
    for name, tensor in tensors.items():
        source = by_model.get(name)
        if source is None:
            continue
        shape, want = tuple(file.shape(source)), tuple(getattr(tensor, "ds_shape", tensor.shape))
        if shape != want:  # (ds_shape: a ZeRO-3 partitioned parameter's whole shape)
            found.mismatched.append(f"{name}: file {shape}, model {want}")
            differ.add(name)
            continue
        filled[id(tensor)] = source
    for name, tensor in tensors.items():  # a tie's every name, whichever the file holds
        if id(tensor) in filled:
            found.sources[name] = filled[id(tensor)]
        elif name not in differ:
            found.missing.append(name)
    found.unexpected = [n for n in by_model if n not in tensors]
    if module is not None and found.missing and found.unexpected:
        _match_stacked(found, file, tensors, module, by_model)
    return found


def _match_stacked(
    found: Matching,
    file: TensorFile,
    tensors: dict[str, torch.Tensor],
    module: nn.Module,
    by_model: dict[str, str],
) -> None:
    """The missing tensors the file holds one per expert (runner.models.stacked_experts),
    matched with their stacked sources (parts under the file's names); their parts no
    longer unexpected."""
    import json

    from runner.models.stacked_experts import MARK, StackedReads, parts_of, stacked_sources

    shapes = {n: tuple(getattr(tensors[n], "ds_shape", tensors[n].shape)) for n in found.missing}
    reads = StackedReads(file)
    used: set[str] = set()
    for name, source in stacked_sources(module, shapes, found.unexpected).items():
        stacked = source.startswith(MARK)
        parts = parts_of(source) if stacked else [source]
        in_file = source if stacked else by_model[source]
        if stacked:
            recipe = json.loads(source[len(MARK) :])
            recipe["groups"] = [[by_model[p] for p in group] for group in recipe["groups"]]
            in_file = MARK + json.dumps(recipe)
        if tuple(reads.shape(in_file)) != shapes[name]:
            continue
        found.sources[name] = in_file
        used.update(parts)
    found.missing = [n for n in found.missing if n not in found.sources]
    found.unexpected = [n for n in found.unexpected if n not in used]


def load_into(module: nn.Module, file: TensorFile, matching: Matching) -> None:
    """Copy each matched tensor into a module that holds all of its weights."""
    with torch.no_grad():
        for name, tensor in loaded_tensors(module).items():
            source = matching.sources.get(name)
            if source is not None:
                tensor.copy_(file.read(source).view(tensor.shape))
