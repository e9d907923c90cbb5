"""What a stock vLLM ``nccl`` worker can receive: refusal or a legal reordering, decided
at plan time, before any control call. The framing rules are the reference:
``plan_packed`` offsets (aligned to each itemsize) and ``pack_host``/``unpack_host``."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.trainer.commit_order import canonical
from tests.trainer.fakes import FAST, DictSource, FakeBackend, FakeServer
from tests.trainer.pause_defaults import ROUND
from weightwire.backends import register_backend
from weightwire.backends.base import SenderCaps, StockRefusal, WirePlan
from weightwire.backends.nccl.stock import plan_for_stock
from weightwire.jax_side.dtypes import describe
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.shared.dtypes import WIRE_DTYPES
from weightwire.shared.framing import pack_host, plan_packed, unpack_host
from weightwire.shared.groups import layer_key
from weightwire.shared.meta import ParamMeta
from weightwire.shared.update_info import UpdateInfo
from weightwire.shared.version import ServerFeatures
from weightwire.trainer import TrainerInitInfo

F33, F31 = ServerFeatures.for_version("0.33.0"), ServerFeatures.for_version("0.31.0")
BIG = 1 << 20


def M(name: str, dtype: str, *shape: int) -> ParamMeta:
    return ParamMeta(name, dtype, tuple(shape))


def aligned(metas: list[ParamMeta], size: int) -> bool:
    return all(
        off % metas[i].itemsize == 0
        for c in plan_packed(metas, size)
        for i, off in zip(range(c.start, c.stop), c.offsets, strict=True)
    )


@pytest.mark.parametrize(
    "pair",
    [
        (M("model.layers.0.a", "int8", 3), M("model.layers.0.b", "float32", 4)),
        (M("model.layers.0.a", "bool", 1), M("model.layers.0.b", "bfloat16", 2)),
        (M("model.layers.0.a", "float8_e4m3fn", 5), M("model.layers.0.b", "int64", 1)),
        (
            M("model.layers.0.a", "int8", 1),
            M("model.layers.0.b", "float32", 0),
        ),  # zero-size views need it too
    ],
    ids=["int8-float32", "bool-bf16", "fp8-int64", "int8-empty-float32"],
)
def test_unaligned_pair_in_one_layer_is_reordered(pair: tuple[ParamMeta, ParamMeta]) -> None:
    metas = list(pair)
    assert not aligned(metas, BIG)
    wire = plan_for_stock(metas, features=F33, packed=True, buffer_size_bytes=BIG)
    assert wire.order == (1, 0) and wire.metas == [metas[1], metas[0]]
    assert aligned(wire.metas, BIG)


def test_aligned_round_keeps_source_order() -> None:
    metas = [
        M("model.layers.0.a", "float32", 4),
        M("model.layers.0.b", "int8", 3),
        M("model.norm", "int8", 1),
    ]
    wire = plan_for_stock(metas, features=F33, packed=True, buffer_size_bytes=BIG)
    assert wire.order is None and wire.metas == metas


def test_chunk_boundary_resets_the_offset() -> None:
    # int8[3] overflows a 2-byte buffer and closes its chunk: float32 starts the next one at 0.
    metas = [M("model.layers.0.a", "int8", 3), M("model.layers.1.b", "float32", 2)]
    assert plan_for_stock(metas, features=F33, packed=True, buffer_size_bytes=2).order is None
    with pytest.raises(StockRefusal, match="'model.layers.1.b'"):
        plan_for_stock(metas, features=F33, packed=True, buffer_size_bytes=BIG)


def test_misalignment_across_layers_is_refused_naming_tensor_and_reason() -> None:
    metas = [
        M("model.layers.0.x", "int8", 3),
        M("model.layers.1.w", "float32", 2),
        M("model.layers.1.v", "int32", 1),
    ]
    with pytest.raises(StockRefusal) as info:
        plan_for_stock(metas, features=F33, packed=True, buffer_size_bytes=BIG)
    msg = str(info.value)
    assert info.value.tensor == "model.layers.1.w"
    for frag in (
        "stock vLLM 0.33.0",
        "'model.layers.1.w'",
        "start at byte 3",
        "4-byte itemsize",
        "model.layers.1.w .. model.layers.1.v (2 tensors)",
        "Nothing was sent",
        "weightwire_nccl",
    ):
        assert frag in msg, (frag, msg)


def test_greedy_prefers_the_order_that_keeps_alignment() -> None:
    # From offset 1, int8[1] first would leave offset 2 and strand the int32; int8[3] first works.
    metas = [
        M("e", "int8", 1),
        M("model.layers.0.a", "int8", 1),
        M("model.layers.0.b", "int8", 3),
        M("model.layers.0.c", "int32", 1),
    ]
    wire = plan_for_stock(metas, features=F33, packed=True, buffer_size_bytes=BIG)
    assert aligned(wire.metas, BIG) and wire.order is not None and wire.order[0] == 0


@pytest.mark.parametrize("dtype", ["bool", "float8_e5m2"])
def test_unpacked_bool_and_e5m2_are_refused(dtype: str) -> None:
    metas = [M("ok", "float8_e4m3fn", 2), M("flag", dtype, 3)]
    with pytest.raises(
        StockRefusal, match=rf"cannot receive 'flag': dtype {dtype} has no NCCL type"
    ):
        plan_for_stock(metas, features=F33, packed=False, buffer_size_bytes=BIG)
    # Packed mode carries them as bytes (itemsize 1: any offset).
    assert plan_for_stock(metas, features=F33, packed=True, buffer_size_bytes=BIG).order is None


@pytest.mark.parametrize(
    ("version", "ok"),
    [
        ("0.30.0", False),
        ("0.31.2", False),
        ("0.32.0rc1", False),
        ("0.32.0", True),
        ("0.33.0", True),
        ("0.35.0", True),
    ],
)
def test_packed_scalars_only_where_view_shape_loads_them(version: str, ok: bool) -> None:
    metas = [M("model.layers.0.w", "float32", 2), M("model.layers.0.scale", "float32")]
    features = ServerFeatures.for_version(version)
    if ok:
        assert (
            plan_for_stock(metas, features=features, packed=True, buffer_size_bytes=BIG).order
            is None
        )
    else:
        with pytest.raises(
            StockRefusal, match=r"'model\.layers\.0\.scale': it is a scalar \(shape \[\]\)"
        ):
            plan_for_stock(metas, features=features, packed=True, buffer_size_bytes=BIG)
    # Unpacked mode has no reshape of a chunk: every version takes the scalar.
    assert (
        plan_for_stock(metas, features=features, packed=False, buffer_size_bytes=BIG).order is None
    )


# --- property: refusal or an aligned, group-preserving order that round-trips the bytes --------

_DTYPES = sorted(WIRE_DTYPES)


@st.composite
def rounds(draw: st.DrawFn) -> tuple[list[ParamMeta], int]:
    metas, n = [], draw(st.integers(1, 12))
    layer = 0
    for i in range(n):
        layer += draw(st.integers(0, 1))
        name = draw(st.sampled_from([f"model.layers.{layer}.t{i}", f"head{i}"]))
        shape = tuple(draw(st.lists(st.integers(0, 5), max_size=2)))
        metas.append(M(name, draw(st.sampled_from(_DTYPES)), *shape))
    return metas, draw(st.sampled_from([1, 7, 16, 64, BIG]))


def _groups(metas: list[ParamMeta]) -> list[list[str]]:
    out: list[list[str]] = []
    last: object = object()
    for m in metas:
        key = layer_key(m.name)
        if out and key == last:
            out[-1].append(m.name)
        else:
            out.append([m.name])
        last = key
    return out


@settings(max_examples=300, deadline=None)
@given(rounds())
def test_plan_is_refused_or_aligned_within_groups(case: tuple[list[ParamMeta], int]) -> None:
    metas, size = case
    try:
        wire = plan_for_stock(metas, features=F33, packed=True, buffer_size_bytes=size)
    except StockRefusal as exc:
        assert not aligned(metas, size) and exc.tensor in {m.name for m in metas}
        return
    assert aligned(wire.metas, size)
    assert [sorted(g) for g in _groups(wire.metas)] == [sorted(g) for g in _groups(metas)]
    # The reordered stream, packed and unpacked by the framing, gives every tensor back.
    rng = np.random.default_rng(0)
    arrays = {
        m.name: rng.integers(0, 255, m.nbytes, dtype=np.uint8)
        .view(WIRE_DTYPES[m.dtype].numpy)
        .reshape(m.shape)
        for m in metas
    }
    stream = list(wire.reorder((m.name, arrays[m.name]) for m in metas))
    assert [n for n, _ in stream] == [m.name for m in wire.metas]
    got = {}
    for chunk in plan_packed(wire.metas, size):
        buf = pack_host([a for _, a in stream[chunk.start : chunk.stop]], chunk)
        got.update(unpack_host(buf, wire.metas, chunk))
    assert {n: a.tobytes() for n, a in got.items()} == {n: a.tobytes() for n, a in arrays.items()}


# --- the engine: refusal before any control call, reordering on the wire ----------------------


class StockFake(FakeBackend):
    name = "fake_stock"
    caps = SenderCaps(on_device=False, stock_receiver=True)

    def plan_round(
        self, metas: Any, *, features: Any, packed: bool, buffer_size_bytes: int
    ) -> WirePlan:
        return plan_for_stock(
            metas, features=features, packed=packed, buffer_size_bytes=buffer_size_bytes
        )


STOCK = StockFake()
register_backend(STOCK, replace=True)


def _engine(server: FakeServer, weights: dict, **info: object) -> JAXTrainerEngine:
    from tests.trainer.fakes import FakeComm

    STOCK.comm = FakeComm()
    kwargs = {"backend": "fake_stock", "timeouts": FAST, "pause_mode": "keep", **info}
    return JAXTrainerEngine.trainer_init(
        TrainerInitInfo(**kwargs),
        client=server.client(),  # type: ignore[arg-type]
        source=DictSource(weights, describe),
    )


def test_engine_refuses_before_pause_or_start_and_stays_usable() -> None:
    server = FakeServer(version="0.31.0")
    weights = {
        "model.layers.0.w": np.ones(3, np.float32),
        "model.layers.0.scale": np.array(2.0, np.float32),
    }
    engine = _engine(server, weights)
    before = server.routes()
    with pytest.raises(StockRefusal, match="'model.layers.0.scale': it is a scalar"):
        engine.send_weights()
    assert (
        server.routes() == before and not STOCK.comm.broadcasts
    )  # no pause, start, update; no byte
    del weights["model.layers.0.scale"]
    engine.send_weights()
    assert canonical(server.routes()[len(before) :]) == ROUND


def test_engine_sends_the_aligned_order_and_its_update_info() -> None:
    server = FakeServer(version="0.33.0")
    rng = np.random.default_rng(1)
    weights = {
        "model.layers.0.mask": rng.integers(0, 2, 2).astype(np.bool_),  # puts b at byte 2
        "model.layers.0.b": rng.standard_normal(1).astype(np.float32),
        "model.layers.0.w": rng.standard_normal((1, 3)).astype(
            ml_dtypes.bfloat16
        ),  # the layer is 12 bytes
        "model.norm.weight": rng.standard_normal(4).astype(np.float32),
    }
    engine = _engine(server, weights, packed_buffer_size_bytes=1 << 16)
    for _ in range(2):  # round 2 reuses the metadata: the worker keeps the wire order it was told
        engine.send_weights()
    first, second = server.bodies("update_weights")
    info = UpdateInfo.from_dict(first["update_info"])
    assert info.names == [
        "model.layers.0.b",
        "model.layers.0.w",
        "model.layers.0.mask",
        "model.norm.weight",
    ]
    assert second["update_info"] == {"names": [], "dtype_names": [], "shapes": []}
    metas = info.metas()
    assert aligned(metas, 1 << 16)
    (chunk,) = plan_packed(metas, 1 << 16)
    want = pack_host([weights[n] for n in info.names], chunk).tobytes()
    assert STOCK.comm.broadcasts == [want, want]


def test_plugin_backends_take_unaligned_rounds_as_is() -> None:
    from tests.trainer.fakes import FAKE, FakeComm

    FAKE.comm = FakeComm()
    server = FakeServer(version="0.31.0")
    weights = {
        "a": np.ones(3, np.int8),
        "b": np.ones(2, np.float32),
        "s": np.array(1.0, np.float32),
    }
    engine = JAXTrainerEngine.trainer_init(
        TrainerInitInfo(backend="fake_host", timeouts=FAST),
        client=server.client(),
        source=DictSource(weights, describe),
    )
    engine.send_weights()
    (body,) = server.bodies("update_weights")
    assert body["update_info"]["names"] == ["a", "b", "s"] and len(FAKE.comm.broadcasts) == 1
