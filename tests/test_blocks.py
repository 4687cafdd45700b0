"""A model's blocks are found without help, and activation checkpointing changes memory, not
results: the same gradients, the same state_dict keys."""

from __future__ import annotations

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


def test_selective_checkpointing_is_bit_identical_and_keeps_the_matmuls() -> None:
    """Every block checkpointed selectively: the same gradients bit for bit (dropout's mask
    recomputed from the same random state), and in the backward pass only the cheap
    operations run again, never a matrix product or attention."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from runner.models.blocks import kept_operations

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(func)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    plain = GPT(vocab_size=32, block_size=16, n_layer=3, n_embd=16, n_head=2, dropout=0.1)
    selective = GPT(vocab_size=32, block_size=16, n_layer=3, n_embd=16, n_head=2, dropout=0.1)
    selective.load_state_dict(plain.state_dict())
    assert apply_activation_checkpointing(selective, every=1, selective=True) == 3
    assert list(selective.state_dict()) == list(plain.state_dict())
    ids = torch.randint(0, 32, (3, 16))
    torch.manual_seed(1)
    want = _grads(plain, ids)
    torch.manual_seed(1)
    loss = selective(ids).float().pow(2).mean()
    with Ops() as backward:
        selective.zero_grad()
        loss.backward()
    got = {name: p.grad.clone() for name, p in selective.named_parameters()}
    assert all(torch.equal(want[name], got[name]) for name in want)
    recomputed = {str(op) for op in backward.seen}
    assert "aten.native_layer_norm.default" in recomputed  # the cheap part, run again
    assert "aten.gelu.default" in recomputed
    forward_only = {str(op) for op in kept_operations()} & {
        "aten._scaled_dot_product_flash_attention_for_cpu.default",
    }
    assert forward_only and not forward_only & recomputed  # attention's forward: kept
