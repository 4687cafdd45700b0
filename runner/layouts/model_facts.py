"""What the planner needs to know of a model, measured without training it and without its
memory: its parameters, its blocks, the activations and FLOPs of one forward and backward
pass under each activation-checkpointing mode, its optimizer's state and temporaries, and
the device's speed.

The model is built on the meta device and given fake storages (torch's FakeTensorMode):
the real model's code runs, with its real shapes and dtypes (autocast included), and no
byte is allocated nor a FLOP computed. `LiveBytes` counts the tensors a pass makes as they
live and die, and the FLOPs of its matrix products, the recomputed ones too
(runner.layouts.live_bytes).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from runner.components import instantiate
from runner.data.datasets import build_datasets
from runner.errors import describe
from runner.hardware import cpu_cores, peak_tflops, threads_per_rank
from runner.layouts.forked import forked_map
from runner.layouts.live_bytes import LiveBytes
from runner.models.blocks import apply_activation_checkpointing, find_blocks
from runner.models.builders import build_model
from runner.models.families import family_of
from runner.models.families.family import NO_EXPERTS
from runner.models.module_names import expand_patterns
from runner.spec import RunSpec
from runner.spec.mesh import offered_splits
from runner.train.step.batch_parts import logits_of, split

MODES = ("none", "full", "selective")
log = logging.getLogger(__name__)


@dataclass
class Pass:
    """One microbatch's forward and backward pass under one checkpointing mode: the peak
    bytes of what it makes (activations, their gradients, temporaries), as `base` plus
    `per_sample` for each sample of the microbatch, and its FLOPs per sample."""

    base: float
    per_sample: float
    flops_per_sample: float
    ops: int  # operations a microbatch runs (each costs a launch, whatever its size)
    # of the peak, the share made inside the modules a tensor plan leaves whole (each rank
    # of a tensor group runs them on the whole sequence: a mixture's experts)
    whole: float = 0.0

    def peak(self, samples: float) -> float:
        return self.base + self.per_sample * samples


@dataclass
class ModelFacts:
    params: list[int]  # elements of each parameter (each once, tied ones too)
    element_bytes: int  # of a parameter (the model's dtype; fp32 for runner's precisions)
    blocks: list[int]  # elements of each block's parameters (the model's repeated layers)
    heads: int | None  # attention heads (what tensor parallelism splits), when the model says
    sequence: int | None  # tokens per sample (token data)
    passes: dict[str, Pass]  # by activation_checkpointing mode
    optimizer_state: float  # optimizer state bytes per parameter byte
    optimizer_temporaries: float  # the peak bytes an optimizer step makes, beyond its state
    device: dict[str, Any] = field(default_factory=dict)  # kind, name, memory, flops
    # FSDP's passes under bf16 or fp16, by mode: its MixedPrecisionPolicy computes on half
    # copies of the weights, so what flows between the layers is half too (ddp's and ZeRO's
    # autocast keeps an fp32 stream over fp32 weights); empty under fp32
    half_passes: dict[str, Pass] = field(default_factory=dict)
    traced_on: str = "cpu"  # the device the passes were traced for (fake tensors of its kind)
    # checkpointing modes whose trace failed, and how (their candidates are refused for it)
    untraceable: dict[str, str] = field(default_factory=dict)
    # the ways the model itself can be split (its own plans): tensor, pipeline, context, expert
    splits: list[str] = field(default_factory=list)
    # its mixture-of-experts layers: experts per layer (0: none), the elements of every
    # experts module expert parallelism splits, and the values a routed token sends to its
    # experts (top_k x width)
    experts: dict[str, int] = field(default_factory=lambda: dict(NO_EXPERTS))

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure(
    spec: RunSpec, nproc: int, device: str, data: Any = None, trace_on: str | None = None
) -> ModelFacts:
    """The facts of `spec`'s model and data (its datasets, built here unless given), with
    `nproc` ranks on a `device` (cpu|cuda). The passes are traced as that device runs them
    (its autocast, its attention kernels), on fake tensors of its kind where this process
    sees one (`trace_on` says which), else on the CPU's."""
    data = build_datasets(spec.data) if data is None else data
    if trace_on is None:
        trace_on = "cuda" if device == "cuda" and torch.cuda.is_available() else "cpu"
    try:
        traced = _Tracer(spec, data.info, data.train[0], trace_on).everything()
    except Exception as error:  # a fake CUDA trace the model cannot take
        if trace_on == "cpu":
            raise
        log.warning("tracing on fake %s tensors failed (%s); traced as on a CPU", trace_on, error)
        trace_on = "cpu"
        traced = _Tracer(spec, data.info, data.train[0], trace_on).everything()
    model, (passes, half_passes, untraceable), (state, temporaries) = traced
    blocks = find_blocks(model)
    unique = list({id(p): p for p in model.parameters()}.values())
    return ModelFacts(
        params=[p.numel() for p in unique],
        element_bytes=unique[0].element_size() if unique else 4,
        blocks=[sum(p.numel() for p in b.parameters()) for b in blocks],
        heads=family_of(model).heads(model),
        sequence=data.info.get("block_size"),
        passes=passes,
        optimizer_state=state,
        optimizer_temporaries=temporaries,
        device=device_facts(device, nproc, calibrate=spec.nodes == 1),
        half_passes=half_passes,
        traced_on=trace_on,
        untraceable=untraceable,
        splits=offered_splits(model),
        experts=family_of(model).experts(model),
    )


class _Tracer:
    """Passes of `spec`'s model on fake tensors (torch's FakeTensorMode), on batches of
    copies of `sample`. The model is built on the meta device once, and each pass's copy
    given fake storages (a model that cannot be built there is built under the fake mode).
    Meta tensors alone would run faster, but their operations are not a CPU's or a GPU's:
    attention on them keeps its whole matrix of scores, which flash attention never holds."""

    def __init__(self, spec: RunSpec, info: dict[str, Any], sample: Any, device: str) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.spec, self.info, self.sample, self.device = spec, info, sample, device
        self.half = HALF.get(spec.precision.name.value)
        self.loss_fn = instantiate(spec.loss.node, info)
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        try:
            with torch.device("meta"):
                self.meta: nn.Module | None = build_model(spec.model, info)
                family_of(self.meta).ready_to_train(self.meta)  # as the ranks train it
        except Exception:  # it reads values as it is built: built under the fake mode each time
            self.meta = None

    def everything(self) -> tuple[nn.Module, tuple[dict, dict], tuple[float, float]]:
        """The whole model (fake), its passes (`passes`), its optimizer's step's figures (on
        the model cut to two blocks: its state per parameter byte and its temporaries per
        byte of the largest tensor are the whole model's, in a fifth of the time)."""
        model = self.model()
        blocks = len(find_blocks(model))
        cut = 2 if blocks > 2 else None
        return model, self.passes(blocks), self.optimizer_step(self.model(blocks=cut))

    def passes(self, blocks: int) -> tuple[dict[str, Pass], dict[str, Pass], dict[str, str]]:
        """Each checkpointing mode's pass over the fp32 weights (ddp's, ZeRO's), and under
        bf16 or fp16 over half copies of them too (FSDP's), for a model of `blocks` blocks;
        and the checkpointing modes whose trace raised, with what (without checkpointing it
        raises: nothing can be planned)."""
        modes = MODES[: 3 if blocks else 1]
        kinds = [(mode, False) for mode in modes]
        kinds += [(mode, True) for mode in modes] if self.half is not None else []
        cut = 2 if blocks > 2 else None
        shapes = [(2, cut), (4, cut), *([(2, cut + 1)] if cut is not None else [])]
        jobs = [(mode, half, samples, kept) for mode, half in kinds for samples, kept in shapes]
        # side by side in forked copies of this process where the fakes are a CPU's (a
        # CUDA context does not survive a fork)
        workers = min(len(jobs), cpu_cores()) if self.device == "cpu" else 1
        traced = forked_map(lambda job: self._traced_or_why(*job), jobs, workers)
        full: dict[str, Pass] = {}
        half: dict[str, Pass] = {}
        untraceable: dict[str, str] = {}
        for k, (mode, is_half) in enumerate(kinds):
            these = traced[k * len(shapes) : (k + 1) * len(shapes)]
            why = next((t for t in these if isinstance(t, str)), None)
            if why is None:
                (half if is_half else full)[mode] = _one_step(these, blocks, cut)
            elif mode == "none":
                raise RuntimeError(why)
            else:
                untraceable.setdefault(mode, why)
        return full, half, untraceable

    def _traced_or_why(self, *job: Any) -> _Traced | str:
        try:
            return self.traced(*job)
        except Exception as exc:  # a model checkpointing cannot run again as it ran first
            return describe(exc)

    def model(self, mode: str = "none", blocks: int | None = None, half: bool = False) -> nn.Module:
        """The model with fake storages, checkpointed by `mode`, cut to its first `blocks`,
        its floating-point weights in the run's half dtype where `half`."""
        if self.meta is None:
            with self.fake:
                model = build_model(self.spec.model, self.info)
            family_of(model).ready_to_train(model)
        else:
            model = copy.deepcopy(self.meta)
        whole = find_blocks(model)
        if mode != "none":
            apply_activation_checkpointing(model, 1, mode == "selective")
        if blocks is not None:
            _keep_blocks(model, whole, blocks)
        if half and self.meta is not None:
            model = model.to(self.half)  # on the meta device, before the fake storages
        with self.fake:
            if self.meta is not None:
                model = model.to_empty(device=self.device)
            elif self.device != "cpu" or half:  # fake tensors are not swapped: set in place
                for tensor in [*model.parameters(), *model.buffers()]:
                    dtype = self.half if half and tensor.is_floating_point() else tensor.dtype
                    tensor.data = tensor.data.to(self.device, dtype)
        return model

    def traced(self, mode: str, half: bool, samples: int, blocks: int | None) -> _Traced:
        """One forward and backward pass of `samples` samples through the model cut to its
        first `blocks`, checkpointed by `mode`, over half weights where `half`."""
        model = self.model(mode, blocks, half)
        with self.fake:
            for p in model.parameters():  # the gradients are state: made before the count
                p.grad = torch.zeros_like(p)
            args, kwargs, targets = split(self._batch(samples))
            live = LiveBytes()
            whole, _ = expand_patterns(model, dict.fromkeys(family_of(model).tensor_whole(model)))
            for name in whole:
                live.within(model.get_submodule(name))
            with live:
                with _autocast(self.spec, self.device):
                    logits = logits_of(model(*args, **kwargs))
                loss_sum = self.loss_fn(logits, targets)[0]
                loss_sum.backward()
                del logits, loss_sum
        share = live.peak_inside / live.peak if live.peak else 0.0
        return _Traced(float(live.peak), live.flops / samples, live.ops, share)

    def _batch(self, samples: int) -> Any:
        """`samples` copies of the sample, collated, as fake tensors."""
        from torch.utils._pytree import tree_map
        from torch.utils.data import default_collate

        def fake(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            faked = self.fake.from_tensor(t)
            if self.device == "cpu":
                return faked
            with self.fake:
                return faked.to(self.device)

        return tree_map(fake, default_collate([self.sample] * samples))

    def optimizer_step(self, model: nn.Module) -> tuple[float, float]:
        """The optimizer's state per parameter byte, and the most bytes a step makes beyond
        its state, on `model` (fake)."""
        from runner.engines.optim import build_optimizer, optimizer_state_bytes

        with self.fake:
            params = list({id(p): p for p in model.parameters()}.values())
            for p in params:
                p.grad = torch.zeros_like(p)
            optimizer = build_optimizer(self.spec.optimizer, model)
            live = LiveBytes()
            with live:
                optimizer.step()  # makes the state
                before = live.now
                live.reset()
                optimizer.step()
            state = optimizer_state_bytes(optimizer)
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        return state / max(1, param_bytes), float(live.peak - before)


def _one_step(traced: list[_Traced], blocks: int, cut: int | None) -> Pass:
    """One forward and backward pass of the whole model under one checkpointing mode, from
    its traces on the model cut to its first two blocks (at 2 and 4 samples: the peak is a
    line in the microbatch's samples; batch norm needs more than one) and to its first
    three (what each further block adds to the peak, and its FLOPs): every further block of
    the model's `blocks` adds alike. (A cut to one block would not do: a single
    checkpointed block is recomputed whole, as if it were not.)"""
    low, high = traced[0], traced[1]
    per_sample = (high.peak - low.peak) / 2
    flops, ops = low.flops, low.ops
    if cut is not None:
        three = traced[2]
        per_sample += (three.peak - low.peak) / 2 * (blocks - cut)  # traced at two samples
        flops += (three.flops - low.flops) * (blocks - cut)
        ops += (three.ops - low.ops) * (blocks - cut)
    return Pass(low.peak - 2 * (high.peak - low.peak) / 2, per_sample, flops, ops, high.whole)


@dataclass
class _Traced:
    peak: float  # the most bytes alive at once
    flops: float  # per sample
    ops: int
    whole: float = 0.0  # the share of `peak` made inside the modules a tensor plan leaves whole


HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _autocast(spec: RunSpec, device: str) -> Any:
    dtype = {**HALF, "float8": torch.bfloat16}.get(spec.precision.name.value)
    return torch.autocast(device, dtype=dtype) if dtype else contextlib.nullcontext()


def _keep_blocks(model: nn.Module, blocks: list[nn.Module], keep: int) -> None:
    """Cut `model`'s container of `blocks` to its first `keep`."""
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, (nn.ModuleList, nn.Sequential)) and list(child) == blocks:
                kept = blocks[:keep]
                cut = (
                    nn.Sequential(*kept)
                    if isinstance(child, nn.Sequential)
                    else nn.ModuleList(kept)
                )
                setattr(parent, name, cut)
                return


CPU_REFERENCE_FLOPS = 50e9  # one core's FP32 rate, for nodes that must all plan alike


def device_facts(device: str, nproc: int, calibrate: bool = True) -> dict[str, Any]:
    """The device a rank runs on: its memory and the FLOP/s it reaches (a GPU's from the
    table of peaks; a CPU's from a short matrix product with the threads a rank gets, or,
    without `calibrate`, a fixed reference: every node of a run plans for itself, and a
    timing, which differs from node to node, could make them pick different layouts)."""
    if device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        name = properties.name
        return {
            "kind": "cuda",
            "name": name,
            "memory": properties.total_memory,
            "flops": {d: (peak_tflops(name, d) or 0.0) * 1e12 for d in ("fp32", "bf16", "fp16")},
        }
    threads = threads_per_rank(nproc)
    return {
        "kind": "cpu",
        "name": f"{cpu_cores()} cores",
        "memory": _ram_bytes() // max(1, nproc),
        "flops": {"fp32": cpu_flops(threads) if calibrate else CPU_REFERENCE_FLOPS * threads},
        "threads": threads,
    }


def _ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def cpu_flops(threads: int, seconds: float = 0.3) -> float:
    """FP32 FLOP/s of a 512x1024 by 1024x1024 product on `threads` threads, timed."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(512, 1024), torch.randn(1024, 1024)
        a @ b  # warm
        runs, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            runs += 1
        return 2 * 512 * 1024 * 1024 * runs / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
