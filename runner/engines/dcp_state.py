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


def load_dcp(
    directory: Path, module: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Load `directory`'s model and optimizer state into `module` and `optimizer` (whatever
    their layout now); return the rest (engine.pt: scheduler, scaler, client)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(module, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(directory / DCP_DIR))
    set_state_dict(
        module,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
    )
    return torch.load(directory / ENGINE_FILE, weights_only=False)


def load_whole(state: dict[str, Any], module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load a whole (unsharded) model and optimizer state, as ddp saves it, into `module` and
    `optimizer` whatever their layout (each rank keeps its shard of every tensor). The
    optimizer's state is keyed by position in its parameter groups; the groups are built
    alike under every parallelism, so position k of group g names the same parameter."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_state_dict,
    )

    names = get_optimizer_state_dict(module, optimizer)["param_groups"]
    saved = state["optimizer"]
    if [len(g["params"]) for g in names] != [len(g["params"]) for g in saved["param_groups"]]:
        raise ValueError("the checkpoint's optimizer groups do not match the configured ones")
    by_name: dict[str, Any] = {}
    groups = []
    for group, named in zip(saved["param_groups"], names, strict=True):
        for index, name in zip(group["params"], named["params"], strict=True):
            if index in saved["state"]:
                by_name[name] = saved["state"][index]
        groups.append({**group, "params": list(named["params"])})
    set_state_dict(
        module,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict={"state": by_name, "param_groups": groups},
        options=StateDictOptions(full_state_dict=True),
    )
