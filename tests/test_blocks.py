"""A model's blocks are found without help, and activation checkpointing changes memory, not
results: the same gradients, the same state_dict keys."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from runner.models.blocks import apply_activation_checkpointing, find_blocks
from runner.models.builders import mlp
from runner.models.gpt import GPT


def test_blocks_are_the_largest_list_of_one_class() -> None:
    gpt = GPT(vocab_size=16, block_size=8, n_layer=3, n_embd=16, n_head=2)
    assert find_blocks(gpt) == list(gpt.blocks)
    assert find_blocks(mlp((4,), 2, hidden_sizes=(8, 8))) == []  # Linear, ReLU, ...: no blocks
    assert find_blocks(gpt, ["LayerNorm"])[0] is gpt.blocks[0].ln_1


def test_hugging_face_layers_are_blocks() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=16, n_positions=8, n_embd=16, n_layer=2, n_head=2)
    )
    assert find_blocks(model) == list(model.transformer.h)


def _grads(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad()
    model(ids).float().pow(2).mean().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_checkpointing_keeps_gradients_and_keys() -> None:
    torch.manual_seed(0)
    plain = GPT(vocab_size=32, block_size=16, n_layer=4, n_embd=16, n_head=2)
    checkpointed = GPT(vocab_size=32, block_size=16, n_layer=4, n_embd=16, n_head=2)
    checkpointed.load_state_dict(plain.state_dict())
    assert apply_activation_checkpointing(checkpointed, every=2) == 2
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    ids = torch.randint(0, 32, (3, 16))
    want, got = _grads(plain, ids), _grads(checkpointed, ids)
    assert all(torch.equal(want[name], got[name]) for name in want)


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["fused-attention", "math-attention"])
def test_selective_checkpointing_is_bit_identical_and_keeps_attention_and_its_inputs(
    dropout: float,
) -> None:
    """Every block checkpointed selectively: the same gradients bit for bit (dropout's mask
    recomputed from the same random state); in the backward pass attention (a fused kernel,
    or on CPU with dropout the math path's) and its input projection (qkv) never run again,
    the MLP's first product and the cheap operations do. Full checkpointing, for contrast,
    runs qkv again."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        """Each operation run, with the width of its output."""

        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            width = out.shape[-1] if isinstance(out, torch.Tensor) and out.ndim else 0
            self.seen.append((str(func), width))
            return out

    def backward_ops(model: nn.Module) -> tuple[list[tuple[str, int]], dict[str, torch.Tensor]]:
        torch.manual_seed(1)
        loss = model(ids).float().pow(2).mean()
        model.zero_grad()
        with Ops() as backward:
            loss.backward()
        return backward.seen, {name: p.grad.clone() for name, p in model.named_parameters()}

    torch.manual_seed(0)
    layers, width = 3, 16
    sizes = {"vocab_size": 32, "block_size": 16, "n_layer": layers, "n_embd": width}
    models = {name: GPT(**sizes, n_head=2, dropout=dropout) for name in ("none", "sel", "full")}
    for model in models.values():
        model.load_state_dict(models["none"].state_dict())
    assert apply_activation_checkpointing(models["sel"], every=1, selective=True) == layers
    apply_activation_checkpointing(models["full"], every=1)
    assert list(models["sel"].state_dict()) == list(models["none"].state_dict())
    ids = torch.randint(0, 32, (3, 16))
    ops, grads = {}, {}
    for name, model in models.items():
        ops[name], grads[name] = backward_ops(model)
        assert all(torch.equal(grads["none"][n], grads[name][n]) for n in grads["none"])
    names = {op for op, _ in ops["sel"]}
    assert {"aten.native_layer_norm.default", "aten.gelu.default"} <= names  # run again
    fused = "aten._scaled_dot_product_flash_attention_for_cpu.default"
    assert fused not in names  # attention's forward: kept
    assert (fused in {op for op, _ in ops["full"]}) is (dropout == 0.0)  # full runs it again

    def products(name: str, out: int) -> int:  # matrix products with `out` columns
        return ops[name].count(("aten.mm.default", out))

    qkv, mlp_hidden = 3 * width, 4 * width  # the widths of qkv's and mlp.0's outputs
    assert products("none", qkv) == products("sel", qkv) == 0  # qkv: kept
    assert products("full", qkv) == layers  # (a backward pass makes no such product)
    assert products("sel", mlp_hidden) == products("none", mlp_hidden) + layers  # mlp.0 again
