"""Every dataset builds from local data only, and the loaders mark placeholder microbatches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from runner.data import Datasets
from runner.data.datasets import build_datasets
from runner.data.digits import digits, read_digits
from runner.data.loaders import build_train_loader
from runner.data.sampler import PLACEHOLDER, GlobalBatchSampler
from runner.data.synthetic import synthetic
from runner.data.vision import cifar10, image_folder
from runner.spec.schema import DataSpec
from tests.helpers.datasets import make_cifar10, make_image_folder


def test_digits_fixed_split() -> None:
    data = build_datasets(DataSpec())  # the default data component
    assert (len(data.train), len(data.val)) == (1438, 359)
    assert data.info == {"input_shape": (1, 8, 8), "num_classes": 10}
    again = digits()
    assert torch.equal(data.val.labels, again.val.labels)


def test_synthetic_is_fixed_and_learnable() -> None:
    a, b = synthetic(), synthetic()
    assert torch.equal(a.train.inputs, b.train.inputs)
    assert a.info["input_shape"] == (3, 32, 32) and len(a.train) == 2048
    # nearest class template (mean of train images per class) beats chance by far
    x, y = a.train.inputs.flatten(1), a.train.labels
    means = torch.stack([x[y == c].mean(0) for c in range(10)])
    predicted = (a.val.inputs.flatten(1) @ means.T).argmax(1)
    assert (predicted == a.val.labels).float().mean() > 0.5
    # a large split is made image by image as it is read: the same images, none held
    large, again = synthetic(image_size=224).train, synthetic(image_size=224).train
    assert large.inputs is None and torch.equal(large[2047][0], again[2047][0])
    images, labels = large.batch([5, 7])
    assert torch.equal(images[1], large[7][0]) and torch.equal(labels, large.labels[[5, 7]])


def test_image_folder_reads_local_files(tmp_path: Path) -> None:
    root = make_image_folder(tmp_path / "imgs")
    data = image_folder(str(root), image_size=16)
    assert (len(data.train), len(data.val), data.info["num_classes"]) == (12, 12, 3)
    x, y = data.train[0]
    assert x.shape == (3, 16, 16) and data.info["input_shape"] == (3, 16, 16)


@pytest.mark.parametrize("decoder", ["torchvision", "pil"])
def test_image_folder_decoders_read_any_file_as_rgb(tmp_path: Path, decoder: str) -> None:
    """JPEG, grayscale PNG and a BMP (torchvision.io cannot read it: Pillow does)."""
    root = make_image_folder(tmp_path / "imgs", classes=2, per_class=1)
    rng = np.random.default_rng(1)
    Image.fromarray(rng.integers(0, 255, (30, 40, 3), dtype=np.uint8)).save(
        root / "train" / "class0" / "photo.jpg"
    )
    Image.fromarray(rng.integers(0, 255, (20, 20), dtype=np.uint8)).save(
        root / "train" / "class0" / "gray.png"
    )
    Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(
        root / "train" / "class1" / "old.bmp"
    )
    data = image_folder(str(root), image_size=16, decoder=decoder)
    for i in range(len(data.train)):
        x, _ = data.train[i]
        assert x.shape == (3, 16, 16) and x.dtype == torch.float32
        assert float(x.min()) > -3 and float(x.max()) < 3  # normalized
    torch.manual_seed(0)
    first = data.train[0][0]
    torch.manual_seed(0)
    assert torch.equal(first, data.train[0][0])  # the augmentation follows torch's stream


def test_cifar10_reads_the_pickle_layout_without_download(tmp_path: Path) -> None:
    root = make_cifar10(tmp_path / "cifar")
    data = cifar10(str(root))
    assert (len(data.train), len(data.val)) == (40, 8)
    assert data.train[0][0].shape == (3, 32, 32)


@pytest.mark.parametrize("kind", ["tensor", "files"])
def test_loader_marks_placeholder_microbatches(tmp_path: Path, kind: str) -> None:
    if kind == "tensor":
        dataset = digits().train
    else:
        dataset = image_folder(str(make_image_folder(tmp_path / "i")), image_size=8).train
    # 3 samples in the last global batch, 2 ranks x 2 microbatches: rank 1 gets a placeholder
    sampler = GlobalBatchSampler(len(dataset), len(dataset) - 1, 2, 1, 2, seed=0)
    batches = list(build_train_loader(dataset, sampler, num_workers=0))
    indices = list(sampler)
    for ((inputs, labels), real), idx in zip(batches, indices, strict=True):
        assert len(inputs) == len(labels) == len(idx)
        assert real == (idx != [PLACEHOLDER])
    assert any(PLACEHOLDER in idx for idx in indices)


def test_info_agrees_with_the_samples(tmp_path: Path) -> None:
    """What the built-in data reports (and the model is built for) is what it serves."""
    for data in [
        digits(),
        synthetic(num_train=8, num_val=4, image_size=12, num_classes=5),
        image_folder(str(make_image_folder(tmp_path / "f")), image_size=16),
        cifar10(str(make_cifar10(tmp_path / "c"))),
    ]:
        x, y = data.train[0]
        assert tuple(x.shape) == data.info["input_shape"]
        assert 0 <= int(y) < data.info["num_classes"]


def test_a_data_component_may_return_a_mapping_a_pair_or_datasets() -> None:
    train, val = [1, 2, 3], [4]
    mapping = Datasets.of({"train": train, "val": val, "vocab_size": 7}, "data")
    assert (mapping.train, mapping.val, mapping.info) == (train, val, {"vocab_size": 7})
    assert Datasets.of((train, val), "data").val is val
    with pytest.raises(TypeError, match="data returned list; expected a mapping"):
        Datasets.of([train], "data")


def test_the_shipped_digits_are_scikit_learns() -> None:
    """runner ships sklearn's digits file (no scikit-learn in the core install): the same
    bytes, and read the same images and labels as load_digits."""
    import sklearn
    from sklearn.datasets import load_digits

    from runner.data.digits import DIGITS_FILE

    theirs = Path(sklearn.__file__).parent / "datasets" / "data" / "digits.csv.gz"
    assert DIGITS_FILE.read_bytes() == theirs.read_bytes()
    images, labels = read_digits()
    bunch = load_digits()
    assert np.array_equal(images, bunch.images) and np.array_equal(labels, bunch.target)


class WordTokenizer:
    """A tokenizer component of the user's: words of a fixed vocabulary."""

    def __init__(self, words: list[str]):
        self.ids = {w: i for i, w in enumerate(words)}
        self.vocab_size = len(words)

    def encode(self, text: str) -> list[int]:
        return [self.ids[w] for w in text.split()]


def test_text_blocks_bytes_or_a_tokenizer_and_ragged_padding(tmp_path: Path) -> None:
    from runner.data.text import text_files

    (tmp_path / "a.txt").write_text("one two three " * 40)
    data = text_files(str(tmp_path), block_size=8)
    assert data.info == {"vocab_size": 256, "block_size": 8, "fixed_length": True}
    sample = data.train[0]
    assert bytes(sample["input_ids"].tolist()) == b"one two "
    assert torch.equal(sample["labels"], sample["input_ids"]) and data.collate_fn is None

    words = text_files(
        str(tmp_path), block_size=4, tokenizer=WordTokenizer(["one", "two", "three"])
    )
    assert words.info["vocab_size"] == 3 and words.train[0]["input_ids"].tolist() == [0, 1, 2, 0]

    ragged = text_files(str(tmp_path), block_size=8, min_length=3)
    assert not ragged.info["fixed_length"]  # a step's tokens are counted, not derived
    batch = ragged.collate_fn([ragged.train[i] for i in range(4)])
    lengths = batch["attention_mask"].sum(1)
    assert len(set(lengths.tolist())) > 1 and batch["input_ids"].shape[1] == lengths.max()
    assert ((batch["labels"] == -100) == (batch["attention_mask"] == 0)).all()
