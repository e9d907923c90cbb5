"""The ``sparse_nccl`` plan: what a stock vLLM sparse worker is posted and sent, and what is
refused before any byte (vLLM's own receiver runs it in tests/interop/test_vllm_sparse.py)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

from tests.shared.vllm_nccl import UNIQUE_ID_KEYS
from weightwire import backends
from weightwire.backends.base import StockRefusal
from weightwire.backends.nccl.info import NCCLInitInfo
from weightwire.backends.nccl.sparse import sparse_nccl_round
from weightwire.backends.nccl.trainer import SparseNCCLBackend
from weightwire.shared.dtypes import wire_name_of_numpy
from weightwire.shared.errors import ConfigError
from weightwire.shared.patches import SparsePatch
from weightwire.shared.version import ServerFeatures
from weightwire.trainer import TrainerInitInfo

V033 = ServerFeatures.for_version("0.33.0")


def describe(a: np.ndarray) -> tuple[str, tuple[int, ...]]:
    return wire_name_of_numpy(a.dtype), tuple(a.shape)


def patch(
    name: str, dtype: Any, shape: tuple[int, ...], index: list[int], **kw: Any
) -> SparsePatch:
    values = kw.get("values", np.arange(len(index)).astype(dtype))
    idx = np.asarray(index, dtype=kw.get("index_dtype", np.int32))
    return SparsePatch(name, wire_name_of_numpy(np.dtype(dtype)), shape, idx, values)


def test_the_update_info_and_the_broadcast_order() -> None:
    a = patch("model.layers.0.mlp.up_proj.weight", ml_dtypes.bfloat16, (4, 3), [0, 5, 11])
    b = patch("model.norm.weight", np.float32, (3,), [1])
    plan = sparse_nccl_round([a, b], features=V033, describe=describe)
    assert plan.update_info == {
        "names": ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"],
        "dtype_names": ["bfloat16", "float32"],
        "shapes": [[4, 3], [3]],
        "num_updates_list": [3, 1],
    }
    # Per patched tensor: the int32 indices, then the values; one broadcast each (unpacked).
    assert [(m.name, m.dtype, m.shape) for m in plan.metas] == [
        ("model.layers.0.mlp.up_proj.weight@index", "int32", (3,)),
        ("model.layers.0.mlp.up_proj.weight@values", "bfloat16", (3,)),
        ("model.norm.weight@index", "int32", (1,)),
        ("model.norm.weight@values", "float32", (1,)),
    ]
    assert [(c.start, c.stop, c.nbytes) for c in plan.chunks] == [
        (0, 1, 12),
        (1, 2, 6),
        (2, 3, 4),
        (3, 4, 4),
    ]
    pairs = list(plan.pairs())
    assert [n for n, _ in pairs] == [m.name for m in plan.metas]
    assert pairs[0][1] is a.index and pairs[1][1] is a.values
    assert plan.full == frozenset()
    full = sparse_nccl_round(
        [patch("model.norm.weight", np.float32, (3,), [0, 1, 2])], features=V033, describe=describe
    )
    assert full.full == {"model.norm.weight"}


@pytest.mark.parametrize(
    ("patches", "error", "match"),
    [
        ([], ValueError, "needs at least one patch"),
        (
            [patch("w", np.int32, (4,), [1])],
            StockRefusal,
            r"backend 'sparse_nccl'\) cannot receive 'w': dtype int32 cannot be patched",
        ),
        (
            [patch("w", ml_dtypes.float8_e4m3fn, (4,), [1])],
            StockRefusal,
            "dtype float8_e4m3fn cannot be patched",
        ),
        (
            [patch("w", np.float32, (4,), [1]), patch("w", np.float32, (4,), [2])],
            ConfigError,
            "twice",
        ),
        ([patch("w", np.float32, (4,), [1], index_dtype=np.int64)], ConfigError, "1-D int32"),
        (
            [patch("w", np.float32, (4,), [1], values=np.zeros(1, np.float16))],
            ConfigError,
            "values must be a 1-D float32",
        ),
        (
            [patch("w", np.float32, (4,), [1, 2], values=np.zeros(1, np.float32))],
            ConfigError,
            "2 indices but 1 values",
        ),
        ([patch("w", np.float32, (4,), [])], ConfigError, "0 changed elements"),
        (
            [patch("w", np.float32, (2,), [0, 1, 1])],
            ConfigError,
            "3 changed elements for a tensor of 2",
        ),
        (
            [patch("w", np.float32, (1 << 16, 1 << 15), [0])],
            ConfigError,
            "cannot be addressed by int32",
        ),
        ([("w", [0], [1.0])], ConfigError, "must be SparsePatch records"),
    ],
)
def test_refused_before_any_byte(patches: list, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        sparse_nccl_round(patches, features=V033, describe=describe)


@pytest.mark.parametrize(
    ("version", "override", "ok"),
    [
        ("0.29.0", None, False),  # no sparse_nccl (and no unique-id rendezvous)
        ("0.30.0", None, True),  # the receive and apply code is the same 0.30 .. 0.33
        ("0.32.0+cpu", None, True),
        ("0.33.0rc1", None, True),  # gated as 0.32
        ("0.34.0", None, False),  # newer: its wire may have changed, so not assumed
        ("0.34.0", "0.33", True),  # the user's word
    ],
)
def test_gated_by_the_version_table(version: str, override: str | None, ok: bool) -> None:
    features = ServerFeatures.for_version(version, override=override)
    backend = SparseNCCLBackend()
    if ok:
        backend.check_server(features)
        return
    with pytest.raises(ValueError, match="lacks (sparse_nccl|unique_id_rendezvous)"):
        backend.check_server(features)
    with pytest.raises(ValueError, match="lacks sparse_nccl"):
        sparse_nccl_round([patch("w", np.float32, (2,), [0])], features=features, describe=describe)


def test_the_init_payload_is_vllms_unpacked_nccl_one() -> None:
    info = TrainerInitInfo(backend="sparse_nccl", packed=True)
    payload = SparseNCCLBackend()._payload(info, bytes(range(128)), 3)
    parsed = NCCLInitInfo.from_dict(payload)
    assert parsed.packed is False and parsed.rank_offset == 1 and parsed.world_size == 3
    assert set(payload) <= set(UNIQUE_ID_KEYS)


def test_whole_tensor_rounds_are_refused_with_the_way_to_send() -> None:
    with pytest.raises(ConfigError, match="receives patches only.*send_patches.*anchor_patches"):
        SparseNCCLBackend().plan_round([], features=V033, packed=False, buffer_size_bytes=1)
    spec = backends.get("sparse_nccl")
    assert spec.stock_receiver and not spec.dense_rounds and not spec.needs_plugin
