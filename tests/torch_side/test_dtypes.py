"""torch <-> wire dtype mapping and chunk unpacking against the numpy golden model."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightwire.shared.dtypes import SUPPORTED_DTYPES
from weightwire.shared.framing import pack_host, plan, unpack_host
from weightwire.shared.meta import ParamMeta
from weightwire.torch_side.dtypes import check_itemsizes, torch_dtype, wire_name
from weightwire.torch_side.worker.receive import unpack_chunk


def test_every_wire_dtype_round_trips():
    for name in SUPPORTED_DTYPES:
        assert wire_name(torch_dtype(name)) == name
    check_itemsizes()
    assert (
        torch_dtype("bfloat16") is torch.bfloat16
        and torch_dtype("float8_e4m3fn") is torch.float8_e4m3fn
    )


def test_unknown_names_and_dtypes_refused():
    with pytest.raises(ValueError, match="unsupported dtype 'load'"):
        torch_dtype("load")  # getattr(torch, "load") would be a function
    with pytest.raises(ValueError, match="complex64 cannot cross the wire"):
        wire_name(torch.complex64)


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


SIMPLE = ["bfloat16", "float16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool"]


@settings(max_examples=60, deadline=None)
@given(
    specs=st.lists(
        st.tuples(st.sampled_from(SIMPLE), st.lists(st.integers(0, 5), max_size=3)),
        min_size=1,
        max_size=8,
    ),
    buffer_size=st.integers(1, 64),
    packed=st.booleans(),
)
def test_unpack_chunk_matches_numpy_golden_model(specs, buffer_size, packed):
    rng = np.random.default_rng(0)
    metas = [ParamMeta(f"t{i}", d, tuple(s)) for i, (d, s) in enumerate(specs)]
    arrays = [rng.integers(0, 256, size=m.nbytes, dtype=np.uint8) for m in metas]
    arrays = [a.view(np.uint8) for a in arrays]
    for chunk in plan(metas, packed=packed, buffer_size_bytes=buffer_size):
        buf = pack_host(arrays[chunk.start : chunk.stop], chunk)
        golden = list(unpack_host(buf, metas, chunk))
        got = unpack_chunk(torch.from_numpy(buf.copy()), metas, chunk)
        assert [n for n, _ in got] == [n for n, _ in golden]
        for (_, t), (_, g), m in zip(got, golden, metas[chunk.start : chunk.stop], strict=True):
            assert t.dtype == torch_dtype(m.dtype) and tuple(t.shape) == m.shape
            assert _as_numpy(t).tobytes() == g.tobytes()


def test_misaligned_tensor_is_copied_out_and_scalars_work():
    metas = [
        ParamMeta("odd", "uint8", (3,)),
        ParamMeta("w", "bfloat16", (2,)),
        ParamMeta("s", "float32", ()),
    ]
    (chunk,) = plan(metas, packed=True, buffer_size_bytes=1 << 10)
    buf = torch.arange(chunk.nbytes, dtype=torch.uint8)
    out = dict(unpack_chunk(buf, metas, chunk))
    assert out["w"].view(torch.uint8).tolist() == [3, 4, 5, 6]
    assert out["s"].shape == () and out["s"].reshape(1).view(torch.uint8).tolist() == [7, 8, 9, 10]
    with pytest.raises(ValueError, match="1-D uint8 of >= 11 bytes"):
        unpack_chunk(buf[:5], metas, chunk)
