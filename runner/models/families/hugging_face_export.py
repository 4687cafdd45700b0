"""The Hugging Face family's side of an export (runner export): its `config.json` beside
the weights (so `from_pretrained` builds the same model and loads them), the names it ties
left out of the weights, as `save_pretrained` leaves them out (the model ties them again
when it loads), the weights under the names Hugging Face's checkpoints use where
transformers keeps them otherwise in memory (a mixture of experts' stacked experts, written
one tensor per expert as `save_pretrained` writes them: every tool that reads Hub
checkpoints reads these), and the run's tokenizer file (`data.tokenizer`) with the config
`AutoTokenizer.from_pretrained` needs."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from runner.models.safetensors_out import OutTensor, replace_with
from runner.spec import RunSpec


def tied_names(module: nn.Module) -> set[str]:
    """Every name of a tensor shared under several names, but the first."""
    seen: set[int] = set()
    tied = set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            tied.add(name)
        seen.add(id(tensor))
    return tied


def hub_names(module: nn.Module, tensors: list[OutTensor]) -> list[OutTensor]:
    """`tensors` under the names of Hugging Face's checkpoints: transformers' own reverse
    of its loading conversions (revert_weight_conversion, transformers 5), one tensor at a
    time; as they are where this transformers has no conversions."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return tensors
    last = _LastConverted(lambda name, t: revert_weight_conversion(module, {name: t}))
    out = []
    for tensor in tensors:
        shapes = last.convert(
            tensor.name, torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        )
        if list(shapes) == [tensor.name]:
            out.append(tensor)
            continue
        for name, shape in shapes.items():
            read = functools.partial(last.part, tensor, name)
            out.append(OutTensor(name, tuple(shape.shape), shape.dtype, read))
    return out


class _LastConverted:
    """The parts of the last tensor converted (the writer asks for a tensor's parts in a
    row): one tensor's conversion held at a time."""

    def __init__(self, convert: Callable[[str, torch.Tensor], dict[str, torch.Tensor]]):
        self.convert = convert
        self.source: str | None = None
        self.parts: dict[str, torch.Tensor] = {}

    def part(self, tensor: OutTensor, name: str) -> torch.Tensor:
        if self.source != tensor.name:
            self.parts, self.source = self.convert(tensor.name, tensor.values()), tensor.name
        return self.parts[name].contiguous()


def write_config(module: nn.Module, directory: Path) -> list[Path]:
    """config.json (and generation_config.json for a model that generates), naming the
    model's class in `architectures` as save_pretrained does (tools pick the class by it)."""
    if not getattr(module.config, "architectures", None):
        module.config.architectures = [type(module).__name__]
    module.config.save_pretrained(directory)
    written = [directory / "config.json"]
    generation = getattr(module, "generation_config", None)
    if generation is not None and module.can_generate():
        generation.save_pretrained(directory)
        written.append(directory / "generation_config.json")
    return written


TOKENIZER_EXTRAS = ("tokenizer_config.json", "special_tokens_map.json")


def copy_tokenizer(spec: RunSpec, directory: Path) -> list[Path]:
    """The run's tokenizer.json (data.tokenizer: the file, or a directory holding it and
    perhaps its tokenizer_config.json), and a tokenizer_config.json naming the fast
    tokenizer class when there was none. Nothing for byte-level data or a tokenizer
    component."""
    given = spec.data.args.get("tokenizer")
    if not isinstance(given, str):
        return []
    path = Path(given)
    main = path / "tokenizer.json" if path.is_dir() else path
    if not main.is_file():
        return []
    written = [directory / "tokenizer.json"]
    replace_with(written[0], main.read_bytes())
    for extra in TOKENIZER_EXTRAS if path.is_dir() else ():
        if (path / extra).is_file():
            replace_with(directory / extra, (path / extra).read_bytes())
            written.append(directory / extra)
    config = directory / "tokenizer_config.json"
    if not config.exists():
        replace_with(config, json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}).encode())
        written.append(config)
    return written
