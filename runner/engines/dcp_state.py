"""A checkpoint in torch.distributed.checkpoint's format (DCP): the model and optimizer under
their plain names (`get_state_dict`), each rank's shards in `dcp/`, and the schedule, loss
scaler and client state in `engine.pt` (rank 0's).

FSDP2 writes it. Any engine whose model and optimizer `get_state_dict` understands reads it:
FSDP2 at another mesh (DCP reshards each tensor to the new placements), and ddp, whose
every rank reads each tensor whole.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

DCP_DIR = "dcp"
ENGINE_FILE = "engine.pt"
STATE_FILE = "state.pt"  # ddp's: the whole state, rank 0's


def is_dcp_checkpoint(directory: Path) -> bool:
    return (directory / DCP_DIR).is_dir()


def sharded_state(module: nn.Module, optimizer: torch.optim.Optimizer, flat: bool = True) -> Any:
    """The model and optimizer state DCP writes: every entry under a parameter's name, the
    optimizer's group settings too (`flat`), so ranks that hold different parameters
    (pipeline stages) write different keys. Unflattened, each rank's groups are one list
    under the same keys, of which DCP keeps one rank's."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.utils._pytree import tree_map

    options = StateDictOptions(flatten_optimizer_state_dict=flat)
    model_state, optimizer_state = get_state_dict(module, optimizer, options=options)
    return tree_map(plain_tensor, {"model": model_state, "optimizer": optimizer_state})


def plain_tensor(value: Any) -> Any:
    """A DTensor whose local part wraps a plain tensor in a subclass (torchao's float8
    weights, which FSDP gathers in float8) as a DTensor of that plain tensor, sharing its
    storage: a checkpoint holds plain tensors, which any process reads back, and loading
    one writes through to the wrapped weight."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return value
    local = value._local_tensor
    flatten = getattr(local, "__tensor_flatten__", None)
    if flatten is None or type(local) is torch.Tensor:
        return value
    names, _ = flatten()
    inner = getattr(local, names[0])
    return DTensor.from_local(
        inner, value.device_mesh, value.placements, run_check=False,
        shape=value.shape, stride=value.stride(),
    )  # fmt: skip


def is_flat(directory: Path) -> bool:
    """Whether a DCP checkpoint's optimizer groups are flattened (runner writes them so
    since pipeline parallelism; earlier checkpoints hold them as a list)."""
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(directory / DCP_DIR)).read_metadata().state_dict_metadata
    return not any(key.startswith("optimizer.param_groups.0.") for key in keys)


def load_dcp(
    directory: Path, module: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Load `directory`'s model and optimizer state into `module` and `optimizer` (whatever
    their layout now); return the rest (engine.pt: scheduler, scaler, client)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    flat = is_flat(directory)
    state = sharded_state(module, optimizer, flat)
    dcp.load(state, checkpoint_id=str(directory / DCP_DIR))
    set_state_dict(
        module,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=StateDictOptions(flatten_optimizer_state_dict=flat),
    )
    return torch.load(directory / ENGINE_FILE, weights_only=False)


def load_whole(
    state: dict[str, Any],
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    whole_groups: list[list[str]] | None = None,
) -> None:
    """Load a whole (unsharded) model and optimizer state, as ddp saves it, into `module` and
    `optimizer` whatever their layout (each rank keeps its shard of every tensor). The
    optimizer's state is keyed by position in its parameter groups; the groups are built
    alike under every parallelism, so position k of group g names the same parameter.
    `whole_groups`: the names in each group of the whole model, where `module` holds part
    of it (a pipeline stage's); by default its own."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_state_dict,
    )

    names = get_optimizer_state_dict(module, optimizer)["param_groups"]
    whole = whole_groups or [list(g["params"]) for g in names]
    saved = state["optimizer"]
    if [len(g) for g in whole] != [len(g["params"]) for g in saved["param_groups"]]:
        raise ValueError("the checkpoint's optimizer groups do not match the configured ones")
    by_name: dict[str, Any] = {}
    settings: dict[str, dict[str, Any]] = {}
    for group, named in zip(saved["param_groups"], whole, strict=True):
        for index, name in zip(group["params"], named, strict=True):
            settings[name] = group
            if index in saved["state"]:
                by_name[name] = saved["state"][index]
    held = {name for g in names for name in g["params"]}
    groups = [{**settings[g["params"][0]], "params": list(g["params"])} for g in names]
    set_state_dict(
        module,
        optimizer,
        model_state_dict={k: v for k, v in state["model"].items() if k in module.state_dict()},
        optim_state_dict={
            "state": {k: v for k, v in by_name.items() if k in held},
            "param_groups": groups,
        },
        options=StateDictOptions(full_state_dict=True),
    )
