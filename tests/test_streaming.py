"""Iterable (streaming) datasets: Hugging Face `datasets` (data=hf_text) and WebDataset
shards, each rank reading its own part; a restart mid-pass ends bit for bit like the run
that never stopped (the position is torchdata's StatefulDataLoader state, saved per rank);
what cannot work is refused before any rank starts."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
import torch

from runner.data.hf_text import hf_text
from runner.data.streams import EveryNth, TrainStream, is_iterable, rank_part
from tests.helpers.cli import FAST
from tests.helpers.refusals import refused
from tests.helpers.streaming import DigitStream, write_shards
from tests.helpers.weights import same_weights

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
STEPS = ["max_epochs=null", "max_steps=16", "log_interval=4", "checkpoint.interval=4"]
KILL = ["chaos.kill_rank=1", "chaos.at_step=14", "max_restarts=1"]  # resumes from step 12


def write_corpus(root: Path, files: int = 4, documents: int = 150) -> str:
    rng = random.Random(0)
    root.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        with open(root / f"part-{f}.jsonl", "w") as out:
            for _ in range(documents):
                words = rng.choices(WORDS, k=rng.randint(5, 60))
                out.write(json.dumps({"text": " ".join(words), "id": f}) + "\n")
    return str(root / "part-*.jsonl")


def take(stream: TrainStream, count: int) -> list[torch.Tensor]:
    return [batch[0] for batch, _ in itertools.islice(stream, count)]


def hf_run(files: str) -> list[str]:
    return [
        "data=hf_text",
        f"data.data_files={files}",
        "data.block_size=16",
        "model=gpt",
        "model.n_layer=1",
        "model.n_head=2",
        "model.n_embd=32",
        "loss=causal_lm",
        "metrics=language_model",
        "precision=fp32",
        "progress_bar=false",
        "global_batch_size=32",
    ]


def test_hf_streaming_splits_by_files_and_holds_out_by_content(tmp_path: Path) -> None:
    files = write_corpus(tmp_path / "corpus")
    streamed = hf_text(files, streaming=True, block_size=16)
    assert is_iterable(streamed.train) and streamed.info["vocab_size"] == 256
    halves = [list(rank_part(streamed.train, r, 2)) for r in range(2)]
    whole = list(streamed.train)
    assert len(halves[0]) + len(halves[1]) == len(whole) > 0  # each file read by one rank
    mapped = hf_text(files, streaming=False, block_size=16)  # the same blocks, map-style
    assert not is_iterable(mapped.train) and len(mapped.train) == len(whole)
    assert len(mapped.val) == sum(1 for _ in streamed.val) > 0
    x, y = mapped.train.batch([0, 1])
    assert x.shape == (2, 16) and torch.equal(x[:, 1:], y[:, :-1])


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_resumes_where_it_was_across_passes(tmp_path: Path, workers: int) -> None:
    """Take 30 batches (several passes over a small part), and again with a stop after 17."""
    data = hf_text(write_corpus(tmp_path / "corpus", documents=4), streaming=True, block_size=16)
    part = rank_part(data.train, 0, 2)

    def stream() -> TrainStream:
        return TrainStream(part, 8, 1, 16, 30, workers, collate_fn=data.collate_fn)

    straight = take(stream(), 30)
    first = stream()
    served = take(first, 17)
    state = first.state_dict()
    assert state["passes"] >= 1
    again = stream()
    again.load_state_dict(state)
    served += take(again, 13)
    assert len(served) == 30 and all(map(torch.equal, straight, served))


@pytest.mark.slow
def test_a_users_stream_is_split_between_ranks_and_workers() -> None:
    stream = DigitStream(0, 100)
    seen = []
    for rank in range(2):
        loader = torch.utils.data.DataLoader(EveryNth(stream, rank, 2), num_workers=2)
        seen += [int(label) for _, label in loader]
    assert len(seen) == 100  # every sample once, across 2 ranks x 2 workers


@pytest.mark.slow
def test_hf_streaming_restart_ends_bit_for_bit(cli, tmp_path: Path) -> None:
    files = write_corpus(tmp_path / "corpus", documents=7)  # about 11 steps a pass
    run = [*hf_run(files), *STEPS, "nproc=2", "data.num_workers=2"]
    reference = cli(*run, name="reference")
    killed = cli(*run, *KILL, name="killed")
    assert reference.returncode == 0 and killed.returncode == 0, killed.output
    assert killed.summary()["resumed_from"] == 12
    passes = [r["epoch"] for r in killed.metrics()]
    assert passes[-1] >= 1, passes  # the run went past the end of a pass
    assert same_weights(reference.run_dir, killed.run_dir)

    # Another world size cannot take over the per-rank positions: refused before launch.
    resumed = refused(*run, "nproc=1", "max_steps=20", f"resume={killed.run_dir}")
    assert "nproc x nodes = 1" in resumed and "world size 2" in resumed


@pytest.mark.slow
def test_webdataset_shards_restart_bit_for_bit(cli, tmp_path: Path) -> None:
    write_shards(tmp_path / "shards")
    run = [
        *FAST,
        "data=custom",
        "data._target_=tests.helpers.streaming.webdataset_digits",
        f"+data.root={tmp_path / 'shards'}",
        *STEPS,
        "global_batch_size=128",  # about 11 steps a pass per rank: the restart is in pass 2
        "nproc=2",
        "data.num_workers=2",
    ]
    reference = cli(*run, name="reference")
    killed = cli(*run, *KILL, name="killed")
    assert reference.returncode == 0 and killed.returncode == 0, killed.output
    assert killed.summary()["resumed_from"] == 12
    assert [r["epoch"] for r in killed.metrics()][-1] == 1
    assert "val/accuracy" in killed.summary()["final"]  # unequal val parts (3 shards, 2 ranks)
    assert same_weights(reference.run_dir, killed.run_dir)


def test_an_iterable_dataset_needs_max_steps(tmp_path: Path) -> None:
    own = refused(*FAST, "data=custom", "data._target_=tests.helpers.streaming.digit_stream")
    assert "max_steps=null" in own and "DigitStream" in own
    files = write_corpus(tmp_path / "corpus", files=1, documents=5)
    assert "max_steps=null" in refused(*hf_run(files), "max_steps=null", "max_epochs=1")


def test_hf_text_bad_input_is_refused_before_launch(tmp_path: Path) -> None:
    missing = refused(*hf_run(str(tmp_path / "nothing-*.jsonl")), "max_steps=2")
    assert "no file matches" in missing
    files = write_corpus(tmp_path / "corpus", files=1, documents=5)
    assert "data.path='imdb'" in refused(*hf_run(files), "max_steps=2", "data.path=imdb")
    assert "data.text_field='body'" in refused(
        *hf_run(files), "max_steps=2", "data.text_field=body"
    )


@pytest.mark.slow
def test_a_users_stream_trains_on_two_ranks(cli) -> None:
    own = [*FAST, "data=custom", "data._target_=tests.helpers.streaming.digit_stream", *STEPS]
    result = cli(*own, "nproc=2", "global_batch_size=64", name="own")
    assert result.returncode == 0, result.output
    assert result.summary()["final"]["val/loss"] > 0


@pytest.mark.slow
def test_hf_text_map_style_is_prepared_once_then_trains(cli, tmp_path: Path) -> None:
    files = write_corpus(tmp_path / "corpus", files=2, documents=20)
    run = [*hf_run(files), "data.streaming=false", "max_epochs=null", "max_steps=4", "nproc=2"]
    result = cli(*run, name="mapped")
    assert result.returncode == 0, result.output
    assert "training blocks in the datasets cache" in result.output
    assert result.summary()["final"]["val/loss"] > 0
