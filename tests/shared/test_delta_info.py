"""Delta rounds in the update info: the new optional fields are strict, a payload without
them is unchanged, and the numpy reference apply / extract agree."""

from __future__ import annotations

import base64
import gc
import json
import pickle
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from weightwire.backends.tcp.info import TCPInitInfo
from weightwire.shared.delta import apply_patch, extract_host
from weightwire.shared.errors import (
    DeltaBaseMismatch,
    RoundError,
    WeightSyncError,
    is_delta_base_mismatch,
)
from weightwire.shared.update_info import UpdateInfo


def delta(**over: Any) -> dict[str, Any]:
    """A valid delta round: ``w`` patched with 3 elements, ``b`` dense."""
    body: dict[str, Any] = {
        "names": ["b", "w@index", "w@values"],
        "dtype_names": ["float32", "int32", "bfloat16"],
        "shapes": [[4], [3], [3]],
        "round_token": "s:2",
        "delta_base": "s:1",
        "patches": [["w", "bfloat16", [2, 8], 3, "flat_i32"]],
    }
    body.update(over)
    return body


def test_delta_info_round_trips() -> None:
    info = UpdateInfo.from_dict(delta())
    assert UpdateInfo.from_json(info.to_json()) == info
    (patch,) = info.patch_list()
    assert (patch.name, patch.dtype, patch.shape, patch.nnz) == ("w", "bfloat16", (2, 8), 3)
    assert (patch.index_name, patch.values_name) == ("w@index", "w@values")
    assert repr(info) == "UpdateInfo(3 tensors, 1 patches)"


def test_a_trainers_tuples_are_the_same_json_as_lists() -> None:
    """A trainer lists shapes and patch entries as tuples of atoms (untracked by the
    collector, #49): the body on the wire is the same bytes, and a worker given the tuples
    themselves (an in-process or pickled call) takes them as it takes the JSON's lists."""
    body = delta()
    tuples = delta(
        shapes=[tuple(s) for s in body["shapes"]],
        patches=[("w", "bfloat16", (2, 8), 3, "flat_i32")],
    )
    assert json.dumps(UpdateInfo(**tuples).to_dict()) == json.dumps(body)
    assert UpdateInfo(**tuples).patch_list() == UpdateInfo.from_dict(body).patch_list()
    assert UpdateInfo.from_json(json.dumps(UpdateInfo(**tuples).to_dict())) == UpdateInfo(**body)


def test_a_delta_updates_rows_read_as_its_metas_and_patches() -> None:
    """A delta update's listing and patches as rows (``MetaRows``, ``PatchRows``, #49): read
    as the ``ParamMeta`` / ``Patch`` lists they stand for (items, slices, equality, the
    framing plan), while the update holds no record per wire tensor or patch: its rows are
    the body's own lists and tuples of atoms, which a collection untracks."""
    from weightwire.shared.delta import Patch
    from weightwire.shared.framing import plan
    from weightwire.shared.meta import MetaRows, ParamMeta

    info = UpdateInfo.from_dict(delta())
    rows, metas = info.meta_rows(), info.metas()
    assert rows == metas and metas == rows and list(rows) == metas and len(rows) == 3
    assert rows[1] == ParamMeta("w@index", "int32", (3,)) and rows[-1] == metas[-1]
    assert rows[1:] == metas[1:] and isinstance(rows[1:], MetaRows)
    assert rows != metas[:2] and rows != [*metas[:2], ParamMeta("w@values", "float32", (3,))]
    assert plan(rows, packed=True, buffer_size_bytes=8) == plan(
        metas, packed=True, buffer_size_bytes=8
    )
    assert rows.names is info.names and rows.shapes is info.shapes  # the body's own lists
    patches = info.patch_list()
    assert patches == [Patch("w", "bfloat16", (2, 8), 3)] and patches[0].numel == 16
    gc.collect()  # untracks the entries' shapes, then (the next) the entries of atoms
    gc.collect()
    assert not any(gc.is_tracked(e) for e in patches.entries)
    with pytest.raises(ValueError, match="2 names, 1 dtypes, 2 shapes"):
        MetaRows(["a", "b"], ["int32"], [[1], [2]])


def test_unset_fields_leave_the_body_unchanged() -> None:
    plain = {"names": ["a"], "dtype_names": ["float32"], "shapes": [[2]]}
    assert UpdateInfo.from_dict(plain).to_dict() == plain
    assert UpdateInfo.from_dict({**plain, "patches": []}).to_dict() == plain
    token = UpdateInfo.from_dict({**plain, "round_token": "s:1"}).to_dict()
    assert token == {**plain, "round_token": "s:1"}


BAD = {
    "base_without_patches": (delta(patches=[]), "delta_base is set but the round has no patches"),
    "patches_without_base": (delta(delta_base=None), "patches need delta_base"),
    "patches_without_token": (delta(round_token=None), "a delta round needs round_token"),
    "empty_token": (delta(round_token=""), "round_token must be a non-empty printable"),
    "token_not_str": (delta(round_token=3), "round_token must be str"),
    "long_base": (delta(delta_base="x" * 257), "delta_base must be a non-empty printable"),
    "patch_not_list": (delta(patches=[{"name": "w"}]), r"patches\[0\] must be \[name"),
    "patch_short": (delta(patches=[["w", "bfloat16", [2, 8], 3]]), r"patches\[0\] must be"),
    "patches_not_list": (delta(patches="w"), "patches must be list"),
    "bad_encoding": (
        delta(patches=[["w", "bfloat16", [2, 8], 3, "coo"]]),
        r"encoding must be one of \['flat_i32'\]",
    ),
    "bad_dtype": (delta(patches=[["w", "complex64", [2, 8], 3, "flat_i32"]]), "complex64"),
    "bad_shape": (delta(patches=[["w", "bfloat16", [-2, 8], 3, "flat_i32"]]), "negative dim"),
    "nnz_zero": (
        delta(
            names=["b", "w@index", "w@values"],
            shapes=[[4], [0], [0]],
            patches=[["w", "bfloat16", [2, 8], 0, "flat_i32"]],
        ),
        r"nnz must be an int in \[1, 16\]",
    ),
    "nnz_over_numel": (
        delta(shapes=[[4], [17], [17]], patches=[["w", "bfloat16", [2, 8], 17, "flat_i32"]]),
        r"nnz must be an int in \[1, 16\]",
    ),
    "nnz_bool": (delta(patches=[["w", "bfloat16", [2, 8], True, "flat_i32"]]), "nnz must be"),
    "nnz_mismatch": (delta(shapes=[[4], [3], [2]]), r"'w@values' must be bfloat16 \[3\]"),
    "index_dtype": (
        delta(dtype_names=["float32", "int64", "bfloat16"]),
        r"'w@index' must be int32 \[3\]",
    ),
    "values_dtype": (
        delta(dtype_names=["float32", "int32", "float32"]),
        r"'w@values' must be bfloat16",
    ),
    "values_missing": (
        delta(names=["b", "w@index", "c"]),
        "names must list 'w@index' then 'w@values', adjacent",
    ),
    "not_adjacent": (
        delta(names=["w@index", "b", "w@values"], dtype_names=["int32", "float32", "bfloat16"]),
        "adjacent",
    ),
    "dense_and_patched": (
        delta(
            names=["w", "w@index", "w@values"],
            dtype_names=["bfloat16", "int32", "bfloat16"],
            shapes=[[2, 8], [3], [3]],
        ),
        "listed both dense and patched",
    ),
    "patched_twice": (
        delta(
            patches=[["w", "bfloat16", [2, 8], 3, "flat_i32"]] * 2,
        ),
        "patched more than once",
    ),
    "stray_suffix": (
        delta(
            names=["b@values", "w@index", "w@values"],
        ),
        "'b@values', a patch wire tensor no patch describes",
    ),
    "reuse_with_patches": (
        {"round_token": "s:2", "delta_base": "s:1", "patches": delta()["patches"]},
        "names must list 'w@index'",
    ),
    "int32_overflow": (
        delta(patches=[["w", "bfloat16", [2**16, 2**15], 3, "flat_i32"]]),
        "more than int32 indices address",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_delta_info_rejects(case: str) -> None:
    payload, match = BAD[case]
    with pytest.raises(ValueError, match=match):
        UpdateInfo.from_dict(payload)
    with pytest.raises(ValueError, match=match):
        UpdateInfo.from_json(json.dumps(payload))


def test_worker_init_info_carries_delta_rounds_only_when_set() -> None:
    base = {
        "host": "127.0.0.1",
        "port": 5000,
        "secret_b64": base64.b64encode(bytes(128)).decode(),
        "rank_offset": 1,
        "world_size": 2,
    }
    assert "delta_rounds" not in TCPInitInfo.from_dict(base).to_dict()
    assert TCPInitInfo.from_dict({**base, "delta_rounds": True}).to_dict()["delta_rounds"] is True
    with pytest.raises(ValueError, match="delta_rounds must be bool"):
        TCPInitInfo.from_dict({**base, "delta_rounds": 1})


def test_delta_base_mismatch_is_recognised_across_http() -> None:
    exc = DeltaBaseMismatch("s:1", None)
    assert str(exc).startswith("DeltaBaseMismatch: ") and "'s:1'" in str(exc)
    assert isinstance(exc, RoundError)
    assert is_delta_base_mismatch(exc)
    copied = pickle.loads(pickle.dumps(exc))
    assert (copied.delta_base, copied.held) == ("s:1", None)
    http = WeightSyncError("update_weights", 500, f"WeightReceiveError: {exc}", "http://x")
    assert is_delta_base_mismatch(http)
    try:
        raise RuntimeError("data plane") from http
    except RuntimeError as chained:
        assert is_delta_base_mismatch(chained)
    assert not is_delta_base_mismatch(WeightSyncError("update_weights", 500, "boom", "x"))


def test_delta_base_mismatch_is_read_from_the_error_field_else_from_the_words() -> None:
    """The reference server names the refusal in its error body (``routes.REFUSAL_FIELD``):
    the trainer reads that field, whatever the message says; stock vLLM's body carries only
    the message (the plugin's words pass through its 500), read as before."""
    import httpx

    from weightwire.control.client import HTTPWeightSyncClient
    from weightwire.shared.errors import DELTA_BASE_MISMATCH
    from weightwire.shared.routes import REFUSAL_FIELD

    def handler(request: httpx.Request) -> httpx.Response:
        error = {"message": "update_weights failed: replica 0: base differs", "code": 409}
        return httpx.Response(409, json={"error": {**error, REFUSAL_FIELD: DELTA_BASE_MISMATCH}})

    client = HTTPWeightSyncClient("http://ref:1", transport=httpx.MockTransport(handler))
    with pytest.raises(WeightSyncError) as refused:
        client.update_weights({"names": [], "dtype_names": [], "shapes": []})
    assert refused.value.refusal == DELTA_BASE_MISMATCH and refused.value.status == 409
    assert DELTA_BASE_MISMATCH not in refused.value.message  # the field alone says it
    assert is_delta_base_mismatch(refused.value)
    assert pickle.loads(pickle.dumps(refused.value)).refusal == DELTA_BASE_MISMATCH
    # a field naming another refusal wins over words quoted in the message
    other = WeightSyncError("update_weights", 409, DELTA_BASE_MISMATCH, "x", refusal="Other")
    assert not is_delta_base_mismatch(other)
    stock = WeightSyncError(  # stock vLLM: no field, the worker's words inside its 500
        "update_weights", 500, f"EngineCore: {DeltaBaseMismatch('s:1', 's:2')}", "http://v"
    )
    assert stock.refusal is None and is_delta_base_mismatch(stock)


@pytest.mark.parametrize(
    "dtype", [np.float32, ml_dtypes.bfloat16, np.float16, np.int8, np.bool_, np.float64]
)
def test_numpy_reference_extract_then_apply_is_exact(dtype: Any) -> None:
    rng = np.random.default_rng(0)
    base = (rng.standard_normal((5, 7)) * 3).astype(dtype)
    new = base.copy()
    flat = new.reshape(-1)
    flat[[0, 9, 34]] = (rng.standard_normal(3) * 3).astype(dtype)
    if np.dtype(dtype).kind == "f":
        flat[3] = np.array(-0.0, dtype)  # a signed zero: equal as a float, other bytes
        base.reshape(-1)[3] = np.array(0.0, dtype)
    index, values = extract_host(base, new)
    assert index.dtype == np.int32 and np.all(np.diff(index) > 0)
    out = apply_patch(base, index, values)
    assert out.tobytes() == new.tobytes()
