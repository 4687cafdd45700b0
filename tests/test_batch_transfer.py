"""A batch reaches the device with each tensor copied once: text's input_ids and labels are
one host tensor (runner.data.text), pinned once and copied once (runner.data.tensor_tree).
On a CPU the copy goes to the meta device, which allocates as a GPU copy would."""

from __future__ import annotations

import torch

from runner.data.loaders import pinning
from runner.data.tensor_tree import map_tensors_once, tensors_of
from runner.train.step.batch_parts import to_device


def test_a_tensor_twice_in_a_batch_is_moved_once_and_stays_one_tensor():
    ids = torch.arange(12).reshape(3, 4)
    mask = torch.ones(3, 4)
    batch = ({"input_ids": ids, "labels": ids, "attention_mask": mask}, [ids, 7])
    calls: list[torch.Tensor] = []

    def move(tensor: torch.Tensor) -> torch.Tensor:
        calls.append(tensor)
        return tensor.to("meta")

    moved = map_tensors_once(batch, move)
    assert len(calls) == 2  # ids and mask, each once
    assert [id(t) for t in tensors_of(batch)] == [id(ids), id(mask)]  # what a copy waits on
    assert moved[0]["input_ids"] is moved[0]["labels"] is moved[1][0]
    assert moved[0]["attention_mask"].device.type == "meta" and moved[1][1] == 7
    assert isinstance(moved[1], list) and batch[0]["input_ids"] is ids  # the host batch kept

    on_meta = to_device({"input_ids": ids, "labels": ids}, "meta")
    assert on_meta["input_ids"] is on_meta["labels"] and on_meta["labels"].device.type == "meta"


def test_channels_last_applies_to_each_image_batch_once():
    images = torch.rand(2, 3, 4, 4)
    moved = to_device((images, images, torch.zeros(2)), "cpu", channels_last=True)
    assert moved[0] is moved[1]
    assert moved[0].is_contiguous(memory_format=torch.channels_last)


def test_pinning_happens_in_the_collate_without_workers_and_in_dataloaders_thread_with():
    collate = sum
    assert pinning(collate, False, 0) == (collate, False)  # nothing pinned on a CPU run
    assert pinning(collate, True, 2) == (collate, True)  # DataLoader's pinning thread
    wrapped, dataloader_pins = pinning(collate, True, 0)
    assert wrapped is not collate and dataloader_pins is False  # pinned as collated
    # (pinning itself needs a CUDA driver: tests/gpu/test_cuda.py pins a text batch)


def test_an_item_carries_its_device_copy_as_a_field_of_its_own() -> None:
    """input_prefetch's copy travels with its batch, after the loader's fields: found by
    its type, never by the batch's identity; an item cut anew has none."""
    from runner.train.step.device_feed import DeviceCopy, copy_of

    batch = (torch.zeros(2, 3), torch.zeros(2))
    copy = DeviceCopy(moved=batch, done=None)
    assert copy_of((batch, True, copy)) is copy
    assert copy_of((batch, True)) is None
    assert copy_of((copy, True)) is None  # the batch itself is never taken for its copy
