"""The data's paths, checked in the parent before any rank starts (no torch, no user code).

`data.root` (where the data component takes one) is made absolute and checked to exist;
for the built-in formats, to hold what they read: image folders, CIFAR-10's files, for
`data=text` a file matching `data.pattern` and the tokenizer file `data.tokenizer` names, and
for `data=hf_text` (no root) its `data.data_files`, each matching a file.
`data.cache_dir` is made absolute, so every node and rank agrees on it.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib.util
from pathlib import Path
from typing import Any

from runner.spec.schema import RunSpec

CIFAR10_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]
IMAGE_FOLDER, CIFAR10 = "runner.data.vision.image_folder", "runner.data.vision.cifar10"
TEXT = "runner.data.text.text_files"
HF_TEXT = "runner.data.hf_text.hf_text"
HF_LOCAL_BUILDERS = ("json", "text", "csv", "parquet", "arrow")  # as runner.data.hf_text
FILE_DATA = {IMAGE_FOLDER, CIFAR10, TEXT}  # built-ins that need a root


def resolve_data_paths(spec: RunSpec, problems: list[str]) -> RunSpec:
    data = spec.data
    args = dict(data.args)
    if data.target == HF_TEXT:
        _check_hf_text(spec, args, problems)
        return dataclasses.replace(spec, data=dataclasses.replace(data, args=args))
    value = args.get("root")
    if value is None:
        if "root" in args and data.target in FILE_DATA:
            problems.append(
                f"data.root=null: data={data.name} reads local files; set data.root=DIR"
            )
        return spec
    if not isinstance(value, str):
        return spec
    root = Path(value).expanduser().resolve()
    args["root"] = str(root)
    if not root.is_dir():
        problems.append(f"data.root={value!r}: directory does not exist")
    elif data.target == IMAGE_FOLDER:
        _check_image_folder(value, root, problems)
    elif data.target == CIFAR10:
        _check_cifar10(value, root, problems)
    elif data.target == TEXT:
        _check_text(value, root, args, problems)
    return dataclasses.replace(spec, data=dataclasses.replace(data, args=args))


def _check_image_folder(value: str, root: Path, problems: list[str]) -> None:
    for split in ("train", "val"):
        split_dir = root / split
        if not split_dir.is_dir() or not any(p.is_dir() for p in split_dir.iterdir()):
            problems.append(
                f"data.root={value!r}: data=image_folder needs {split}/<class>/<images> "
                f"under the root; {split_dir} has no class folders"
            )


def _check_cifar10(value: str, root: Path, problems: list[str]) -> None:
    batches = root / "cifar-10-batches-py"
    missing = [f for f in CIFAR10_FILES if not (batches / f).is_file()]
    if missing:
        problems.append(
            f"data.root={value!r}: data=cifar10 needs the python-pickle files under "
            f"{batches} (missing: {', '.join(missing)}); runner never downloads data"
        )


def _check_text(value: str, root: Path, args: dict, problems: list[str]) -> None:
    pattern = args.get("pattern", "**/*.txt")
    if isinstance(pattern, str) and not any(p.is_file() for p in root.glob(pattern)):
        problems.append(f"data.root={value!r}: no file matches data.pattern={pattern!r}")
    _check_tokenizer(args, problems)
    _check_cache_dir(args, problems, root)


def _check_tokenizer(args: dict, problems: list[str]) -> None:
    tokenizer = args.get("tokenizer")
    if isinstance(tokenizer, str):  # runner.data.tokenizing reads it (and says the same)
        path = Path(tokenizer).expanduser().resolve()
        if path.is_dir() and not (path / "tokenizer.json").is_file():
            problems.append(
                f"data.tokenizer={tokenizer!r}: the directory has no tokenizer.json (write one "
                "with a Hugging Face tokenizer's save_pretrained(DIR), or name the file)"
            )
        elif not path.exists():
            problems.append(f"data.tokenizer={tokenizer!r}: no such file or directory")
        args["tokenizer"] = str(path)


def _check_cache_dir(args: dict, problems: list[str], root: Path | None = None) -> None:
    cache_dir = args.get("cache_dir")
    if isinstance(cache_dir, str):
        path = Path(cache_dir).expanduser().resolve()
        if path.exists() and not path.is_dir():
            problems.append(f"data.cache_dir={cache_dir!r}: exists and is not a directory")
        elif path == root:
            problems.append(
                f"data.cache_dir={cache_dir!r}: the corpus folder itself; use a folder of its "
                "own, such as ${data.root}/.runner-cache"
            )
        args["cache_dir"] = str(path)


def _check_hf_text(spec: RunSpec, args: dict, problems: list[str]) -> None:
    """data=hf_text: local builders and files only, made absolute; streaming needs max_steps."""
    if importlib.util.find_spec("datasets") is None:
        problems.append(
            "data=hf_text: needs the datasets package, which is not installed "
            "(pip install 'runner[data]')"
        )
    path = args.get("path")
    if path not in HF_LOCAL_BUILDERS:
        problems.append(
            f"data.path={path!r}: runner reads local files only; valid: "
            + ", ".join(HF_LOCAL_BUILDERS)
        )
    files = args.get("data_files")
    if files is None:
        problems.append("data.data_files=null: data=hf_text reads local files; set data.data_files")
    else:
        args["data_files"] = _absolute_files(files, problems)
    if args.get("streaming") and spec.max_steps is None:
        problems.append(
            "max_steps=null: data=hf_text with data.streaming=true is an iterable dataset (no "
            f"length), so max_epochs={spec.max_epochs} cannot end the run; set max_steps"
        )
    _check_tokenizer(args, problems)
    _check_cache_dir(args, problems)


def _absolute_files(files: Any, problems: list[str]) -> Any:
    """data.data_files with every path or glob absolute; one that matches nothing is named."""
    if isinstance(files, dict):
        return {k: _absolute_files(v, problems) for k, v in files.items()}
    if isinstance(files, (list, tuple)):
        return [_absolute_files(v, problems) for v in files]
    pattern = str(Path(str(files)).expanduser().absolute())
    if not any(Path(p).is_file() for p in glob.glob(pattern, recursive=True)):
        problems.append(f"data.data_files={str(files)!r}: no file matches")
    return pattern
