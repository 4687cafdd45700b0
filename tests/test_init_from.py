"""Starting from pretrained weights (`init_from`): the files runner reads, how their names
meet the model's, and runs that start from a Hugging Face model saved here (no download)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from runner.cli.command_line import expand_shorthands
from runner.models.pretrained import loaded_tensors, match
from runner.models.tensor_files import WeightsFileError, open_tensor_file, tensor_file
from runner.spec.schema import InitFromSpec
from tests.helpers.cli import MATRIX
from tests.helpers.hugging_face import GPT2, gpt2_args, text_corpus
from tests.helpers.refusals import refused

TENSORS = {
    "embed.weight": torch.randn(6, 4),
    "head.bias": torch.randn(3).to(torch.bfloat16),
    "steps": torch.tensor(7, dtype=torch.int64),
    "blocks.0.weight": torch.randn(2, 3, 5),
}


def _formats(tmp_path: Path) -> dict[str, Path]:
    torch.save(TENSORS, tmp_path / "model.pt")
    save_file(TENSORS, str(tmp_path / "one.safetensors"))
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file(TENSORS, str(hf / "model.safetensors"))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    names = list(TENSORS)
    weight_map = {}
    for i, part in enumerate((names[:2], names[2:])):
        file = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: TENSORS[n] for n in part}, str(sharded / file))
        weight_map.update(dict.fromkeys(part, file))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    torch.save(TENSORS, run_dir / "model.pt")
    return {
        "model.pt": tmp_path / "model.pt",
        "safetensors": tmp_path / "one.safetensors",
        "hf directory": hf,
        "sharded directory": sharded,
        "sharded index": sharded / "model.safetensors.index.json",
        "run directory": run_dir,
    }


def test_every_format_reads_the_same_tensors_and_any_run_of_them(tmp_path: Path) -> None:
    for kind, path in _formats(tmp_path).items():
        with tensor_file(path) as file:
            assert sorted(file.names()) == sorted(TENSORS), kind
            for name, tensor in TENSORS.items():
                assert file.shape(name) == tuple(tensor.shape), (kind, name)
                flat = tensor.reshape(-1)
                assert torch.equal(file.read(name), flat), (kind, name)
                if flat.numel() > 3:
                    assert torch.equal(file.read(name, 2, 3), flat[2:5]), (kind, name)
                    assert torch.equal(file.read(name, 4, 1000), flat[4:]), (kind, name)


def test_what_is_not_a_weights_file_says_why(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("not weights")
    (tmp_path / "empty").mkdir()
    torch.save([1, 2], tmp_path / "list.pt")
    bad = tmp_path / "bad"
    bad.mkdir()
    index = {"weight_map": {"a": "gone.safetensors"}}
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    (tmp_path / "fake.safetensors").write_bytes(b"\xff" * 16)
    cases = {
        tmp_path / "nothing": "no such file or directory",
        tmp_path / "notes.txt": "neither safetensors nor a torch.save file; give a model.pt",
        tmp_path / "empty": "a directory with no model.safetensors.index.json, ",
        tmp_path / "list.pt": "holds a list, not a state_dict of tensors",
        bad: "model.safetensors.index.json names ",
        tmp_path / "fake.safetensors": "not a readable safetensors file",
    }
    for path, expected in cases.items():
        with pytest.raises(WeightsFileError) as info:
            open_tensor_file(path)
        assert expected in str(info.value), (path, str(info.value))


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("cache", torch.zeros(2), persistent=False)


def _saved(tmp_path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    return path


def test_names_meet_through_the_prefixes_and_a_tie_counts_once(tmp_path: Path) -> None:
    model = Tied()
    wanted = {k: v for k, v in model.state_dict().items() if k != "head.weight"}  # as saved
    path = _saved(tmp_path, {f"module.{k}": torch.randn(v.shape) for k, v in wanted.items()})
    with tensor_file(path) as file:
        spec = InitFromSpec(path=str(path), strip_prefix="module.")
        matching = match(file, loaded_tensors(model), spec)
        assert matching.missing == [] and matching.unexpected == [] and not matching.mismatched
        assert matching.sources["head.weight"] == "module.embed.weight"  # through the tie
        assert "cache" not in matching.sources  # not persistent: not a file's business
        assert matching.problems(spec) == []

        unmapped = InitFromSpec(path=str(path))
        off = match(file, loaded_tensors(model), unmapped)
        assert sorted(off.missing) == sorted(model.state_dict())
        problems = off.problems(unmapped)
        assert problems[0].startswith(f"init_from.path={path}: missing: 5 (")
        assert "init_from.strict=false loads what matches" in problems[0]
        assert problems[1].startswith(f"init_from.path={path}: unexpected: 4 (module.")
        assert off.problems(InitFromSpec(path=str(path), strict=False)) == []


def test_a_shape_that_differs_is_an_error_even_when_not_strict(tmp_path: Path) -> None:
    model = Tied()
    tensors = {k: v.clone() for k, v in model.state_dict().items() if k != "head.weight"}
    tensors["body.weight"] = torch.zeros(4, 5)
    path = _saved(tmp_path, tensors)
    spec = InitFromSpec(path=str(path), strict=False)
    with tensor_file(path) as file:
        matching = match(file, loaded_tensors(model), spec)
    assert matching.problems(spec) == [
        f"init_from.path={path}: shapes differ: 1 (body.weight: file (4, 5), model (4, 4))"
    ]


def test_init_from_path_is_the_groups_shorthand() -> None:
    assert expand_shorthands(["init_from=/w", "init_from.strict=false", "seed=1"]) == [
        "init_from.path=/w",
        "init_from.strict=false",
        "seed=1",
    ]
    assert expand_shorthands(["init_from={path:/w,strict:false}"]) == [
        "init_from={path:/w,strict:false}"
    ]


# ----------------------------------------------------------------- runs (slow)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return text_corpus(tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("parallelism", ["ddp", pytest.param("fsdp", marks=MATRIX), "zero3"])
def test_a_run_starts_from_a_saved_hugging_face_model(
    cli, tmp_path: Path, corpus: Path, parallelism: str
) -> None:
    """save_pretrained here (no download); a run whose step cannot move a weight (lr 1e-30)
    ends with the saved weights, under each way of holding the model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1)
    saved = GPT2LMHeadModel(GPT2Config(**GPT2))
    saved.save_pretrained(tmp_path / "hf")  # model.safetensors, the tied head left out
    result = cli(
        *gpt2_args(corpus),
        f"parallelism={parallelism}",
        "init_from=hf",  # relative: to where runner starts (the test's directory)
        "optimizer.lr=1e-30",
        "max_steps=1",
        "eval_batches=1",
    )
    assert result.returncode == 0, result.output
    assert f"init_from: {tmp_path / 'hf'}" in result.rank_log(0)
    if parallelism != "ddp":  # each rank read only its own shards of the file
        assert "meta_init: each rank holds only its shards" in result.rank_log(0)
    trained = torch.load(result.run_dir / "model.pt", weights_only=True)
    expected = saved.state_dict()
    assert trained.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=1e-20, msg=name)


@pytest.mark.slow
def test_names_that_do_not_match_stop_the_run_before_any_rank_starts(cli, tmp_path: Path) -> None:
    path = _saved(tmp_path, {"encoder.weight": torch.zeros(2, 2)})
    found = refused(f"init_from={path}", "max_steps=2")
    assert f"init_from.path={path}: missing: 6 (1.weight, 1.bias," in found
    assert f"init_from.path={path}: unexpected: 1 (encoder.weight)" in found

    loose = cli(f"init_from={path}", "init_from.strict=false", "max_steps=2", name="loose")
    assert loose.returncode == 0, loose.output
    assert "missing (seeded instead): 6 (1.weight" in loose.rank_log(0)
