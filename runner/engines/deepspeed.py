"""DeepSpeed ZeRO stages 1, 2 and 3, with runner's own optimizer and schedule as client
objects.

DeepSpeed counts microbatches itself: every microbatch's backward is followed by
its `step()`, which only updates the weights at the accumulation boundary. Our
loss is already weighted by the microbatch's share of the global batch, so it
is not divided by grad_accum again (`scale_wrt_gas=False`).

Mixed precision is what it is under ddp and fsdp (runner.spec.deepspeed_config): fp32
weights, gradients and optimizer, the forward pass under torch.autocast, and for fp16 a
dynamic loss scale (`LossScale`) that behaves as torch's GradScaler does.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from contextlib import AbstractContextManager
from functools import partial
from pathlib import Path
from typing import Any

import torch

from runner import dist as rdist
from runner.engines.base import Engine, FinalTensor
from runner.engines.deepspeed_ops import import_deepspeed
from runner.engines.optim import build_optimizer
from runner.engines.rank_model import RankModel
from runner.engines.schedules import build_scheduler
from runner.errors import describe
from runner.spec import Precision, RunSpec
from runner.spec.deepspeed_config import merge_user_config

DEEPSPEED_TAG = "state"


def to_universal(source: Path, target: Path) -> None:
    """DeepSpeed's ds_to_universal, in a child process (it runs worker pools of its own)."""
    command = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        f"--input_folder={source}",
        f"--output_folder={target}",
        "--num_extract_workers=1",
        "--num_merge_workers=1",
        "--inject_missing_state",  # runner's checkpoints carry no Megatron metadata
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise RuntimeError(
            f"converting {source} to DeepSpeed's universal checkpoint failed: "
            + (lines[-1] if lines else f"exit status {done.returncode}")
        )


def partitioned_construction(spec: RunSpec, device: str) -> Any:
    """ZeRO-3's zero.Init: every parameter is partitioned across the ranks as soon as its
    module is built (DeepSpeedEngine's `fill` then sets the partitions' values)."""
    deepspeed = import_deepspeed(spec.parallelism.name, device)
    config, _ = merge_user_config(spec)
    deepspeed.init_distributed(dist_init_required=False)  # adopts torch's process group
    return deepspeed.zero.Init(config_dict_or_path=config)


def share_master_partitions(zero3: Any) -> None:
    """Let ZeRO-3's fp32 master partitions be the parameters' own partitions where those are
    fp32 already (an fp32 run without optimizer offload): one copy of the partition fewer,
    4 bytes per parameter over the ranks. DeepSpeed means to do this itself, but its test
    compares a tensor's device with a device name (`tensor.device == "cpu"`), which is never
    true, so it keeps a second copy. Done before the first step: the optimizer has no state
    for the masters yet, and DeepSpeed finds them by index, never by identity."""
    flats, masters = zero3.fp16_partitioned_groups_flat, zero3.fp32_partitioned_groups_flat
    if zero3.offload_optimizer or zero3.optimizer.state:
        return
    for i, (flat, master) in enumerate(zip(flats, masters, strict=True)):
        if flat is None or (flat.dtype, flat.device) != (master.dtype, master.device):
            continue
        flat.ds_id, flat.requires_grad = master.ds_id, master.requires_grad
        masters[i] = flat  # the step updates the partition in place; the copy back is a no-op


class LossScale:
    """fp16's dynamic loss scale under ZeRO, kept as torch's GradScaler keeps it under ddp and
    fsdp. ZeRO is handed the scale (`override_loss_scale`): it multiplies each microbatch's
    loss by it, divides it out of the gradients before clipping and stepping, and skips a
    step whose gradient norm is not finite (the norm is global, so every rank skips alike).
    After each step the scale halves on an overflow, and doubles after `growth_interval`
    steps in a row without one."""

    def __init__(self, init_scale: float, growth_interval: int):
        self.scale, self.growth_interval, self.good_steps = init_scale, growth_interval, 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale, self.good_steps = self.scale * 0.5, 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale, self.good_steps = self.scale * 2.0, 0

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


LOSS_SCALE_KEY = "runner_loss_scale"  # in DeepSpeed's client state, beside runner's own


class DeepSpeedEngine(Engine):
    def __init__(self, spec: RunSpec, rank_model: RankModel):
        name, module, device, fill = (
            spec.parallelism.name,
            rank_model.module,
            rank_model.device,
            rank_model.fill,
        )
        total_steps = rank_model.total_steps
        deepspeed = import_deepspeed(name, device)
        config, _ = merge_user_config(spec)  # conflicts were rejected by the parent
        if fill is not None:  # built partitioned (zero.Init): the values, before any copy
            fill(module)
        optimizer = scheduler = None
        self.stage = spec.parallelism.stage
        if not spec.eval_only:
            optimizer = build_optimizer(spec.optimizer, module)
            scheduler = build_scheduler(spec.scheduler, optimizer, total_steps)
        elif self.stage < 3:  # runner eval: ZeRO-1/2 need an optimizer; stage 0 wraps the model
            config = {**config, "zero_optimization": {**config["zero_optimization"], "stage": 0}}
        try:
            self.model, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=module,
                optimizer=optimizer,
                lr_scheduler=scheduler,
                config=config,
                dist_init_required=False,
            )
        except Exception as exc:
            raise RuntimeError(
                f"parallelism={name}: DeepSpeed failed to initialise: {describe(exc)}"
            ) from exc
        self.module = self.model.module
        self.loss_scale: LossScale | None = None
        if optimizer is None:  # runner eval: stage 3 partitions the weights, nothing steps
            return
        if self.stage == 3:
            share_master_partitions(self.model.optimizer)
        self.watch_state(optimizer)  # ZeRO steps our optimizer on its own partitions
        if spec.precision.name is Precision.FP16:
            self.loss_scale = LossScale(spec.precision.init_scale, spec.precision.growth_interval)
            zero = self.model.optimizer
            # DeepSpeed's torch_autocast section brings a GradScaler of its own for fp16, which
            # ZeRO would step without unscaling before it clips; ours replaces it.
            zero.torch_autocast_gradscaler = None
            zero.override_loss_scale(self.loss_scale.scale)

    def _held_parameters(self) -> list[torch.Tensor]:
        # ZeRO-3's optimizer holds its fp32 masters in its param_groups only while it steps.
        masters = getattr(self.model.optimizer, "fp32_partitioned_groups_flat", [])
        return [*super()._held_parameters(), *masters]

    def _held_grads(self) -> list[torch.Tensor]:
        # ZeRO-3 reduces into one buffer of gradient partitions, and steps each sub-group of
        # its partition on a flat copy of that sub-group's part of it.
        buffer = getattr(self.model.optimizer, "grad_partitions_flat_buffer", None)
        return [*super()._held_grads(), *([] if buffer is None else [buffer])]

    def microbatch(self, index: int, count: int) -> AbstractContextManager[Any]:
        # Said each time: with grad_accum=auto the count changes within a step.
        self.model.set_gradient_accumulation_boundary(index == count - 1)
        return contextlib.nullcontext()

    keeps_microbatches = True  # ZeRO accumulates reduced gradients in its own partitions

    def drop_pass(self) -> None:
        pass  # ZeRO-1/2 communicate in backward only: a forward pass leaves nothing behind

    def backward_scale(self) -> torch.Tensor | float:
        return self.loss_scale.scale if self.loss_scale is not None else 1.0

    def backward(self, loss: torch.Tensor) -> None:
        self.model.backward(loss, scale_wrt_gas=False)
        self.note_grad_bytes()  # ZeRO-1 holds whole gradients until the boundary's reduction
        boundary = self.model.is_gradient_accumulation_boundary()
        self.model.step()  # a no-op for the weights except at the accumulation boundary
        if boundary and self.loss_scale is not None:
            self._rescale()

    def _rescale(self) -> None:
        """After an fp16 step: the next scale, from whether ZeRO found an overflow (a host
        bool it has already read). A step skipped for one still advances the schedule, as
        the optimizer step GradScaler skips does under ddp and fsdp."""
        assert self.loss_scale is not None
        overflow = bool(self.model.optimizer.overflow)
        self.loss_scale.update(overflow)
        self.model.optimizer.override_loss_scale(self.loss_scale.scale)
        if overflow:
            self.scheduler.step()

    def step(self) -> None:
        pass  # done by the last microbatch's backward()

    def grad_norm_share(self) -> torch.Tensor | float:
        """The norm ZeRO computed in the step the last backward() took (the same on every
        rank; its square over the world size is this rank's share)."""
        world = rdist.get_world_size()
        norm = self.model.get_global_grad_norm()
        if norm is None:
            return -1.0 / world
        norm = torch.as_tensor(norm, dtype=torch.float64)
        return norm.square() / world

    @property
    def nonfinite_skips(self) -> int:
        """DeepSpeed skips a step whose global gradient norm is not finite (under fp16 that
        is its loss scaler at work, not a fault)."""
        return 0 if self.loss_scale is not None else self.model.skipped_steps

    def save_checkpoint(self, directory: Path, client_state: dict[str, Any]) -> None:
        # DeepSpeed's own layout (directory/latest + directory/state/...), so its tools
        # such as zero_to_fp32.py work on a runner checkpoint directory.
        if self.loss_scale is not None:
            client_state = {**client_state, LOSS_SCALE_KEY: self.loss_scale.state_dict()}
        self.model.save_checkpoint(str(directory), tag=DEEPSPEED_TAG, client_state=client_state)

    def load_checkpoint(self, directory: Path, reshard: Path | None = None) -> dict[str, Any]:
        if reshard is None:
            path, client_state = self.model.load_checkpoint(str(directory), tag=DEEPSPEED_TAG)
        else:
            path, client_state = self._load_universal(directory, reshard)
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint in {directory}")
        saved_scale = client_state.pop(LOSS_SCALE_KEY, None)
        if self.loss_scale is not None and saved_scale is not None:
            self.loss_scale.load_state_dict(saved_scale)
            self.model.optimizer.override_loss_scale(self.loss_scale.scale)
        return client_state

    def _load_universal(self, directory: Path, scratch: Path) -> tuple[Any, dict[str, Any]]:
        """Another world size: rank 0 converts the checkpoint to DeepSpeed's universal
        format (one file per parameter and state, independent of the partitioning), then
        every rank loads its own partition of it."""
        if rdist.get_global_rank() == 0:
            to_universal(directory / DEEPSPEED_TAG, scratch / DEEPSPEED_TAG)
        rdist.barrier()
        config = self.model._config
        config.load_universal_checkpoint = True
        try:
            return self.model.load_checkpoint(str(scratch), tag=DEEPSPEED_TAG)
        finally:
            config.load_universal_checkpoint = False

    def final_tensors(self) -> list[FinalTensor]:
        """The fp32 weights. ZeRO 1/2 hold them whole on every rank (in every precision:
        the forward pass casts them under autocast); ZeRO-3 partitions every parameter,
        which is gathered when its turn comes (a collective per parameter)."""
        from deepspeed.utils import safe_get_full_fp32_param

        partitioned = self.stage == 3
        params = dict(self.module.named_parameters(remove_duplicate=False))
        tensors = []
        for name, value in self.module.state_dict().items():
            shape = getattr(params.get(name), "ds_shape", value.shape)  # ZeRO-3: the whole
            dtype = torch.float32 if value.is_floating_point() else value.dtype
            gather = value.detach
            if partitioned and name in params:
                gather = partial(safe_get_full_fp32_param, params[name])
            tensors.append(FinalTensor(name, torch.Size(shape), dtype, gather))
        return tensors
