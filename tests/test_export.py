"""`runner export`: a run's weights as safetensors (sharded, with the index), from model.pt
or any parallelism's checkpoint, and the fine-tuning loop end to end: a Hugging Face model
saved here, fine-tuned from `init_from` under fsdp, exported, loaded by `from_pretrained`."""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from runner.export.command import shard_bytes
from runner.models.checkpoint_weights import NoWeights, find_weights
from runner.models.safetensors_out import OutTensor, write_safetensors
from tests.helpers.cli import FAST, HANG, MATRIX, child_env, runner_command
from tests.helpers.hugging_face import GPT2, gpt2_args, text_corpus

TENSORS = {
    "a.weight": torch.randn(5, 3),
    "b.bias": torch.randn(7).to(torch.bfloat16),
    "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    "d": torch.tensor(2.5),
}


def _out(tensors: dict[str, torch.Tensor]) -> list[OutTensor]:
    return [OutTensor(n, tuple(t.shape), t.dtype, lambda t=t: t) for n, t in tensors.items()]


def _read_all(directory: Path) -> dict[str, torch.Tensor]:
    found: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        found.update(load_file(str(file)))
    return found


def test_one_file_or_shards_with_their_index(tmp_path: Path) -> None:
    single = write_safetensors(tmp_path / "one", _out(TENSORS), max_shard_bytes=10**6)
    assert [p.name for p in single] == ["model.safetensors"]
    with safe_open(str(single[0]), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}  # what transformers checks
    sharded = write_safetensors(tmp_path / "many", _out(TENSORS), max_shard_bytes=60)
    assert sharded[-1].name == "model.safetensors.index.json"
    assert sharded[0].name == f"model-00001-of-{len(sharded) - 1:05d}.safetensors"
    index = json.loads(sharded[-1].read_text())
    assert set(index["weight_map"]) == set(TENSORS)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in _out(TENSORS))
    for written in (tmp_path / "one", tmp_path / "many"):
        read = _read_all(written)
        assert read.keys() == TENSORS.keys()
        assert all(torch.equal(read[k], v) for k, v in TENSORS.items())


def test_a_tensor_that_cannot_be_read_leaves_no_file(tmp_path: Path) -> None:
    def broken() -> torch.Tensor:
        raise OSError("disk gone")

    tensors = [*_out(TENSORS), OutTensor("e", (2,), torch.float32, broken)]
    with pytest.raises(OSError, match="disk gone"):
        write_safetensors(tmp_path / "out", tensors, max_shard_bytes=10**6)
    assert list((tmp_path / "out").iterdir()) == []  # no file, whole or partial


def test_sizes_and_what_has_no_weights(tmp_path: Path) -> None:
    assert shard_bytes("5GB") == 5 * 10**9 and shard_bytes("2GiB") == 2 * 2**30
    assert shard_bytes("500mb") == 500 * 10**6 and shard_bytes("1024") == 1024
    with pytest.raises(argparse.ArgumentTypeError, match="give a size such as 5GB"):
        shard_bytes("lots")
    with pytest.raises(NoWeights, match="no model.pt and no complete checkpoint"):
        find_weights(tmp_path)
    with pytest.raises(NoWeights, match="nope: no such file or directory"):  # not "no model.pt"
        find_weights(tmp_path / "nope")


def _export(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        runner_command("export", *map(str, args)),
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=HANG,
        env=child_env(),
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "parallelism", ["ddp", pytest.param("zero3", marks=MATRIX), "fsdp"]
)  # fmt: skip
def test_every_checkpoint_exports_the_weights_of_model_pt(
    cli, tmp_path: Path, parallelism: str, capsys
) -> None:
    """`runner export` of a run's checkpoint and of its model.pt, by the command's own code in
    the test's process (the command itself: the refusal below, the Hugging Face round trip
    and tests/test_terminal.py's typed export)."""
    import warnings

    from runner.export.command import main

    run = cli(*FAST, f"parallelism={parallelism}", "max_epochs=null", "max_steps=3")
    assert run.returncode == 0, run.output
    final = torch.load(run.run_dir / "model.pt", weights_only=True)
    (checkpoint,) = (run.run_dir / "checkpoints").glob("step_*")
    for source, name in ((checkpoint, "from-checkpoint"), (run.run_dir, "from-run")):
        capsys.readouterr()
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            code = main([str(source), "--to", str(tmp_path / name), "--max-shard-size", "20KB"])
        done = capsys.readouterr()
        assert code == 0, done.out + done.err
        assert not warned, [str(w.message) for w in warned]  # fsdp's DCP read: torch's, 58e01cd
        assert "Warning" not in done.err, done.err
        read_from = run.run_dir / "model.pt" if source == run.run_dir else checkpoint
        assert f"runner export: {read_from} -> " in done.out
        assert (tmp_path / name / "model.safetensors.index.json").is_file()  # sharded
        exported = _read_all(tmp_path / name)
        assert exported.keys() == final.keys(), name
        assert all(torch.equal(exported[k], v) for k, v in final.items()), name

    if parallelism == "ddp":  # what has no weights, once through the command (exit 2)
        empty = tmp_path / "empty"
        empty.mkdir()
        done = _export(tmp_path, empty, "--to", tmp_path / "nothing")
        assert done.returncode == 2 and "no model.pt and no complete checkpoint" in done.stderr
        assert "Traceback" not in done.stderr and not (tmp_path / "nothing").exists()


@pytest.mark.slow
def test_fine_tune_a_hugging_face_model_and_hand_it_back(cli, tmp_path: Path) -> None:
    """The loop: save_pretrained (no download) -> runner fine-tunes it from init_from under
    fsdp -> runner export -> from_pretrained loads it -> its logits are model.pt's."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(1)
    GPT2LMHeadModel(GPT2Config(**GPT2)).save_pretrained(tmp_path / "pretrained")
    corpus = text_corpus(tmp_path)
    tokenizer = _tokenizer(corpus, tmp_path / "tokenizer.json")
    run = cli(
        *gpt2_args(corpus),
        f"data.tokenizer={tokenizer}",
        "parallelism=fsdp",
        "activation_checkpointing=selective",  # recomputed without transformers' cache
        f"init_from={tmp_path / 'pretrained'}",
        "max_steps=4",
        "eval_batches=1",
    )
    assert run.returncode == 0, run.output
    assert "model: use_cache=false for training" in run.rank_log(0)
    assert "is an Enum subclass" not in run.output + run.rank_log(0)  # torchao's, to torch
    done = _export(tmp_path, run.run_dir, "--to", tmp_path / "hf")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "a Hugging Face model" in done.stdout
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert loaded.config.use_cache  # the user's value, for generation
    text = "the lazy dog jumps"
    ids = AutoTokenizer.from_pretrained(tmp_path / "hf")(text)["input_ids"]
    assert ids == Tokenizer.from_file(str(tokenizer)).encode(text).ids  # the run's tokenizer

    reference = GPT2LMHeadModel(GPT2Config(**GPT2)).eval()
    reference.load_state_dict(torch.load(run.run_dir / "model.pt", weights_only=True))
    tokens = torch.randint(0, 60, (3, 16))  # the tokenizer's ids
    with torch.no_grad():
        expected, got = reference(tokens).logits, loaded(tokens).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    assert not torch.equal(  # fine-tuned: not the weights it started from
        load_file(str(tmp_path / "pretrained" / "model.safetensors"))["transformer.wte.weight"],
        loaded.state_dict()["transformer.wte.weight"],
    )


def _tokenizer(corpus: Path, path: Path) -> Path:
    """A small BPE tokenizer trained on the corpus (vocabulary 60: within GPT-2's 256)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["[UNK]"])
    tokenizer.train([str(f) for f in corpus.glob("*.txt")], trainer)
    tokenizer.save(str(path))
    return path


def test_dtype_converts_the_floating_tensors_only(tmp_path: Path, capsys) -> None:
    from runner.export.command import main

    torch.save(TENSORS, tmp_path / "model.pt")
    assert (
        main([str(tmp_path / "model.pt"), "--to", str(tmp_path / "bf16"), "--dtype", "bf16"]) == 0
    )
    assert "4 tensors" in capsys.readouterr().out
    exported = _read_all(tmp_path / "bf16")
    for name, value in TENSORS.items():
        expected = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert exported[name].dtype == expected.dtype and torch.equal(exported[name], expected)
