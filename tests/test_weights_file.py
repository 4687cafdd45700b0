"""model.pt written one tensor at a time (runner.train.checkpoints.weights_file): what
torch.load reads back, a valid archive, and nothing left behind by a write that fails halfway."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
import torch

from runner.engines.base import FinalTensor
from runner.train.checkpoints.weights_file import write_weights


def entries(state: dict[str, torch.Tensor], gathered: list[str]) -> list[FinalTensor]:
    def gather(name: str):
        def fetch() -> torch.Tensor:
            gathered.append(name)
            return state[name]

        return fetch

    return [FinalTensor(k, v.shape, v.dtype, gather(k)) for k, v in state.items()]


def example_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "embed.weight": torch.randn(7, 5),
        "blocks.0.attn.weight": torch.randn(5, 5).t(),  # not contiguous
        "blocks.0.norm.scale": torch.randn(5, dtype=torch.bfloat16),
        "step": torch.tensor(3),  # 0-dim
        "empty": torch.zeros(0, 4),
        "mask": torch.tensor([True, False, True]),
        "head.weight": torch.randn(3, 5, dtype=torch.float64),
    }


def test_round_trip_is_a_plain_state_dict(tmp_path: Path) -> None:
    state, gathered = example_state(), []
    path = tmp_path / "model.pt"
    write_weights(path, entries(state, gathered))
    assert gathered == list(state)  # once each, in order
    loaded = torch.load(path, weights_only=True)
    assert list(loaded) == list(state)
    for name, value in state.items():
        assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value), name
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None  # every record's CRC-32 is right
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


def test_converted_to_the_laid_out_dtype(tmp_path: Path) -> None:
    value = torch.randn(4, 3, dtype=torch.bfloat16)
    entry = FinalTensor("w", value.shape, torch.float32, lambda: value)
    write_weights(tmp_path / "model.pt", [entry])
    loaded = torch.load(tmp_path / "model.pt", weights_only=True)["w"]
    assert loaded.dtype == torch.float32 and torch.equal(loaded, value.float())


def test_a_failed_write_keeps_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.save({"old": torch.ones(2)}, path)
    state = example_state()
    tensors = entries(state, [])

    def broken() -> torch.Tensor:
        raise OSError(28, "No space left on device")

    tensors[3] = FinalTensor("step", state["step"].shape, state["step"].dtype, broken)
    with pytest.raises(OSError, match="No space"):
        write_weights(path, tensors)
    assert list(torch.load(path, weights_only=True)) == ["old"]
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


def test_a_tensor_gathered_in_another_shape_is_an_error(tmp_path: Path) -> None:
    entry = FinalTensor("w", torch.Size([4, 3]), torch.float32, lambda: torch.zeros(3, 4))
    with pytest.raises(RuntimeError, match=r"w gathered as \(3, 4\), laid out"):
        write_weights(tmp_path / "model.pt", [entry])
    assert not list(tmp_path.iterdir())
