"""PyTorch's FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded
across ranks, each block sharded on its own and then the root.

Gradient reduction uses sums only and divides afterwards (`set_force_sum_reduction_for_comms`):
averaging reduce-scatter on gloo has had a silent-correctness bug (pytorch/pytorch#162338).
Gradients are synced once per step: every microbatch but the last runs without sync.
FSDP2 does not broadcast weights; every rank builds the same ones (same seed). Batch-norm
buffers are not synced.

HSDP (`replicate` > 1): a 2-D device mesh, (replicate, shard); each of the `replicate`
groups of consecutive ranks holds a whole copy of the model, sharded among its ranks.
Gradients are reduce-scattered within a group and all-reduced across groups.

Checkpoints are torch.distributed.checkpoint (DCP): sharded, every rank writes its own
shards, and a checkpoint loads at another world size and another layout.
"""

from __future__ import annotations

import functools
import logging
from concurrent.futures import Future
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from runner import dist as rdist
from runner.engines.base import Engine, FinalTensor, local_grad_norm
from runner.engines.dcp_state import (
    DCP_DIR,
    ENGINE_FILE,
    STATE_FILE,
    is_dcp_checkpoint,
    load_dcp,
    load_whole,
    sharded_state,
)
from runner.engines.precision import DTYPES, grad_scaler
from runner.engines.rank_model import Apart, RankModel
from runner.spec import RunSpec

log = logging.getLogger(__name__)


class FSDPEngine(Engine):
    def __init__(self, spec: RunSpec, rank_model: RankModel):
        """FSDP2's shards over `rank_model`'s data mesh: each of its blocks on its own, then each
        root; then the optimizer over this rank's shards."""
        module, grid = rank_model.module, rank_model.grid
        _shard(rank_model, spec.parallelism, spec.precision.name)
        self.module = self.model = module
        self.device_type = torch.device(rank_model.device).type
        self.digest = spec.checkpoint.digest  # checkpoint files digested as they are written
        self.replicas = spec.parallelism.replicas
        self.stages, self.loss_context = rank_model.stages, rank_model.loss_context
        self.several_meshes, self.stage_world = rank_model.several_meshes, grid.stage_world
        self.tensor = grid.tensor
        if grid.replicate > 1:
            copies, shards = grid.replicate, grid.shard
            log.info("fsdp: HSDP: %d copies, each sharded over %d ranks", copies, shards)
        self.grad_clip_norm = spec.grad_clip_norm
        self.params = list(module.parameters())  # the sharded ones, listed once
        self.build_optimizer(spec, module, rank_model.total_steps)
        # fp16: torch's GradScaler works on FSDP2's DTensor gradients, and DTensor reduces its
        # overflow check over the mesh, so every rank steps or skips alike.
        self.scaler = grad_scaler(spec.precision, self.device_type)

    @property
    def grad_copies(self) -> int:
        return self.replicas

    def grad_norm_share(self) -> torch.Tensor | float:
        """Under tensor parallelism some gradients are held whole by every rank of a group
        (the norms'), or as partial sums: the global norm, which DTensor reduces over the
        mesh (a collective: log steps only), shared evenly."""
        if self.tensor == 1 or self.clip_norm is not None:
            return super().grad_norm_share()
        if not any(p.grad is not None for p in self.params):
            return -1.0 / rdist.get_world_size()
        # a stage's ranks share its norm (every stage's, summed)
        return global_grad_norm(self.params).double().square() / self.stage_world

    def microbatch(self, index: int, count: int) -> AbstractContextManager[Any]:
        """Gradients sync at the last microbatch. The pass runs in the rank_model's loss context
        (tensor parallelism: loss parallel's, where a loss on split logits has its backward)."""
        self.model.set_requires_gradient_sync(index == count - 1)
        return self.loss_context()

    def communicating_modules(self) -> list[nn.Module]:
        from torch.distributed.fsdp import FSDPModule

        return [m for m in self.module.modules() if isinstance(m, FSDPModule)]

    def drop_pass(self) -> None:
        # Ranks stopped in different blocks: FSDP's recovery reshards every block and clears
        # the iteration's state (forward root, prefetch order), so the next pass starts alike.
        self.module.reset_iter_state()
        super().drop_pass()

    def prepare_step(self, norm_wanted: bool = True) -> torch.Tensor | None:
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        norm = None
        if self.grad_clip_norm is not None and self.several_meshes:
            norm = global_grad_norm(self.params)  # this rank's stages', on several meshes
            norm = self.clip_norm = self.stages.grad_norm(norm.double().square()).float()
            clip_to(self.params, self.grad_clip_norm, norm)
        elif self.grad_clip_norm is not None:  # the global norm (a collective): clipping needs it
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip_norm)
            norm = self.clip_norm = norm.to_local() if hasattr(norm, "to_local") else norm
        elif self.scaler is None and norm_wanted:  # this rank's shards: the guard combines them
            norm = local_grad_norm(self.params)
        return None if self.scaler else norm  # under fp16 the scaler owns overflow

    def final_tensors(self) -> list[FinalTensor]:
        """The sharded state_dict under the plain model's names; each DTensor is gathered
        whole when its turn comes."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        local = [
            FinalTensor(name, value.shape, value.dtype, partial(gathered, value))
            for name, value in get_model_state_dict(self.module).items()
        ]
        return self.stages.final_tensors(local)

    def save_checkpoint(self, directory: Path, client_state: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(self._sharded_state(), storage_writer=self._writer(directory / DCP_DIR))
        self._save_extra(directory, client_state)

    can_save_async = True
    _checkpoint_group: Any = None
    _stager: Any = None

    def save_checkpoint_async(self, directory: Path, client_state: dict[str, Any]) -> Future:
        """DCP's async_save: each rank's shards are copied to CPU memory now and written by
        a thread, whose collectives (agreeing on the rank_model, the coordinator's metadata) run
        on a gloo group of their own, so they never interleave with the training's."""
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        if self._checkpoint_group is None:  # every rank, at the same (first) save
            self._checkpoint_group = dist.new_group(backend="gloo")
        if self._stager is None or not stager_reusable():
            if self._stager is not None:  # its last save is written (the Checkpointer waits)
                self._stager.close()
            self._stager = _shared_memory_stager(self.device_type)
        future = dcp.async_save(
            self._sharded_state(),
            storage_writer=self._writer(directory / DCP_DIR),
            process_group=self._checkpoint_group,
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=self._stager,
        )
        self._save_extra(directory, client_state)
        return future

    def _writer(self, path: Path) -> Any:
        """DCP's file-system writer; with checkpoint.digest, one that digests each file as it
        is written (runner.engines.dcp_writer)."""
        from torch.distributed.checkpoint import FileSystemWriter

        from runner.engines.dcp_writer import DigestingFileSystemWriter

        return (DigestingFileSystemWriter if self.digest else FileSystemWriter)(str(path))

    def _sharded_state(self) -> dict[str, Any]:
        return sharded_state(self.module, self.optimizer)

    def _save_extra(self, directory: Path, client_state: dict[str, Any]) -> None:
        """Rank 0: the schedule, the loss scaler and the client state (small; at once)."""
        if rdist.get_global_rank() == 0:
            extra = {
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler else None,
                "client": client_state,
            }
            torch.save(extra, directory / ENGINE_FILE)

    def load_checkpoint(self, directory: Path, reshard: Path | None = None) -> dict[str, Any]:
        """Its own DCP shards at any mesh, or ddp's whole state (each rank keeps its part)."""
        if is_dcp_checkpoint(directory):
            extra = load_dcp(directory, self.module, self.optimizer)
        else:
            extra = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=False)
            load_whole(extra, self.module, self.optimizer, self.stages.whole_groups)
        self.scheduler.load_state_dict(extra["scheduler"])
        if self.scaler and extra.get("scaler"):
            self.scaler.load_state_dict(extra["scaler"])
        return extra["client"]


def _shard(rank_model: RankModel, options: Any, precision: Any) -> None:
    """fully_shard over the rank_model's data mesh: each block (its gathered weights freed after
    its forward pass, but where the rank_model keeps them), then each root; then, for a model
    built without its weights, this rank's shards filled in."""
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        FSDPModule,
        MixedPrecisionPolicy,
        OffloadPolicy,
        fully_shard,
    )

    from runner.engines.device_mesh import data_mesh

    policy = MixedPrecisionPolicy(param_dtype=DTYPES.get(precision), reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy() if options.cpu_offload else OffloadPolicy()
    kwargs = {"mp_policy": policy, "offload_policy": offload, "mesh": data_mesh(rank_model.mesh)}
    for block, reshard in zip(rank_model.blocks, _reshards(options, rank_model), strict=True):
        for apart in rank_model.apart.get(id(block), []):  # first: the block's shards the rest
            _shard_apart(apart, reshard, kwargs)
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    for root in rank_model.roots:
        fully_shard(root, reshard_after_forward=options.reshard_after_forward, **kwargs)
    if rank_model.fill is not None:  # built on the meta device: this rank's shards only, now
        rank_model.fill(rank_model.module)
    for sharded in {id(m): m for r in rank_model.roots for m in r.modules()}.values():
        if isinstance(sharded, FSDPModule):
            sharded.set_force_sum_reduction_for_comms(True)


def _shard_apart(apart: Apart, reshard: bool, kwargs: dict) -> None:
    """Modules sharded on a mesh of their own (an expert group's experts), their reduced
    gradient divided by the rest of its mean where FSDP has summed it (its all-reduce hook,
    after the reduce-scatter, before FSDP's own division by the mesh: FSDP's own divide
    factor is applied twice on a one-rank mesh, torch 2.11 to 2.15)."""
    from torch.distributed.fsdp import fully_shard

    fully_shard(apart.module, reshard_after_forward=reshard, **{**kwargs, "mesh": apart.mesh})
    if apart.divide != 1:
        apart.module.set_all_reduce_hook(functools.partial(_divide, by=apart.divide))


def _divide(reduced: torch.Tensor, by: int) -> None:
    reduced.div_(by)


def _reshards(options: Any, rank_model: RankModel) -> list[bool]:
    """Per block, whether FSDP frees its gathered weights after the forward pass. Not the
    last block's: backward gathers it again at once (the root's, FSDP keeps itself); not
    any where the rank_model keeps every block's (each microbatch of a pipeline would gather it
    again); the last one's too where the rank_model says so (weights gathered in float8: their
    scales are computed for the sharded weights)."""
    n = len(rank_model.blocks)
    if not options.reshard_after_forward or rank_model.keep_every_gathered:
        return [False] * n
    return [not (rank_model.keep_last_gathered and i == n - 1) for i in range(n)]


def global_grad_norm(params: list[torch.Tensor]) -> torch.Tensor:
    """The norm of every gradient, each element once, on the device: DTensor reduces it over
    each mesh (a rank_model may leave some parameters off the tensor dimension, so gradients sit
    on several meshes), and the meshes' squares add up."""
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for param in params:
        if param.grad is not None:
            by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param.grad)
    squares = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        squares.append(norm.double().square())
    return torch.stack(squares).sum().sqrt().float()


def clip_to(params: list[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale every gradient by max_norm / norm where that is below 1 (torch's rule), in
    place on each rank's part: a shard, a copy or a partial sum scales alike."""
    coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for param in params:
        if param.grad is not None:
            grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
            grad.mul_(coefficient.to(grad.dtype))


def _shared_memory_stager(device_type: str) -> Any:
    """The copy an asynchronous save writes from: in shared memory, which the background
    process reads without another copy, kept from one checkpoint to the next (pinned for
    the copy off a GPU)."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = device_type == "cuda"
    return DefaultStager(StagingOptions(cuda, True, False, cuda))


@functools.cache
def stager_reusable() -> bool:
    """Whether one DefaultStager can stage one save after another. torch 2.11's closes its
    copier at the end of each stage, and the next save through it fails while copying
    (`KeyError: <class 'type'>`); later releases keep it open, so its shared-memory buffers
    are reused. Found out by staging a small state twice."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    probe = DefaultStager(StagingOptions(False, False, False, False))
    state = {"tensor": torch.zeros(1), "group": {"betas": (0.9, 0.95), "params": ["w"]}}
    try:
        probe.stage(state)
        probe.stage(state)
        return True
    except KeyError:
        return False
    finally:
        probe.close()


def gathered(value: torch.Tensor) -> torch.Tensor:
    """A DTensor whole: an all-gather over its mesh, from the mesh's device where the shards
    are offloaded to the CPU. A plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return value.detach()
    if value.device.type != value.device_mesh.device_type:
        value = value.to(value.device_mesh.device_type)
    return value.full_tensor()
