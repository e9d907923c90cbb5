"""``PatchSplitter`` (``torch_side.worker.delta``): what a delta update's chunks leave held.

A chunk of patch wire tensors only is held as it landed (views of its buffer: no copy per
wire tensor, which on a GPU is a launch and the patch's bytes again); a chunk that also
carries dense tensors has its patch wire tensors copied out, so its buffer can go once the
dense ones are loaded. Either way the held patches are the bytes sent."""

from __future__ import annotations

import pytest
import torch

from weightwire.shared.delta import Patch
from weightwire.torch_side.worker.delta import PatchSplitter

PATCH = Patch("w", "bfloat16", (4, 8), 3)


def _chunk(*, dense: bool) -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """One chunk's buffer and its views, as a link's unpack makes them."""
    buf = torch.zeros(64, dtype=torch.uint8)
    buf[0:12].view(torch.int32).copy_(torch.tensor([1, 5, 30], dtype=torch.int32))
    bits = torch.tensor([0x3FC0, -0x8000, 0x7FC1], dtype=torch.int16)  # 1.5, -0.0, a NaN
    buf[12:18].view(torch.int16).copy_(bits)
    pairs = [
        ("w@index", buf[0:12].view(torch.int32)),
        ("w@values", buf[12:18].view(torch.bfloat16)),
    ]
    if dense:
        pairs.append(("norm.weight", buf[32:64].view(torch.bfloat16)))
    return buf, pairs


def _shares_memory(t: torch.Tensor, buf: torch.Tensor) -> bool:
    return t.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


@pytest.mark.parametrize("dense", [False, True], ids=["patches-only", "beside-dense"])
def test_a_chunk_of_patches_only_is_held_as_it_landed(dense: bool) -> None:
    buf, pairs = _chunk(dense=dense)
    sent = {name: t.clone() for name, t in pairs}
    splitter = PatchSplitter([PATCH], observe=None)
    passed = [p for chunk in splitter.split(iter([pairs])) for p in chunk]
    assert [name for name, _ in passed] == (["norm.weight"] if dense else [])
    (held,) = splitter.patches
    # beside dense tensors the patch is copied out (the chunk's buffer may go); alone, not
    assert _shares_memory(held.index, buf) is not dense
    assert _shares_memory(held.values, buf) is not dense
    assert torch.equal(held.index, sent["w@index"])
    assert torch.equal(held.values.view(torch.int16), sent["w@values"].view(torch.int16))
