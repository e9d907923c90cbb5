"""``UnpackPlan`` (one tensor op per tensor, planned once per metadata) against the
previous per-tensor slicing, and the worker's plan cache (``MetaCache``) around it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch

from tests.torch_side._local_core import local_core, local_init
from weightwire.backends.receiving import ChunkedLink
from weightwire.backends.worker_base import ReceiveLink, ReceiveProgress, ReceiveTurn
from weightwire.shared.dtypes import SUPPORTED_DTYPES
from weightwire.shared.framing import Chunk, pack_host, plan
from weightwire.shared.meta import ParamMeta
from weightwire.shared.update_info import UpdateInfo
from weightwire.torch_side.dtypes import torch_dtype
from weightwire.torch_side.worker.core import _ReceiverCore
from weightwire.torch_side.worker.load import MetaCache
from weightwire.torch_side.worker.receive import UnpackPlan, unpack_chunk


def reference_unpack(
    buffer: torch.Tensor, metas: Sequence[ParamMeta], chunk: Chunk
) -> list[tuple[str, torch.Tensor]]:
    """The unpacking every worker ran before ``UnpackPlan``: the behaviour to keep."""
    out = []
    for meta, offset in zip(metas[chunk.start : chunk.stop], chunk.offsets, strict=True):
        dtype = torch_dtype(meta.dtype)
        if meta.nbytes == 0:
            out.append((meta.name, torch.empty(meta.shape, dtype=dtype, device=buffer.device)))
            continue
        raw = buffer[offset : offset + meta.nbytes]
        if offset % dtype.itemsize:
            raw = raw.clone()
        out.append((meta.name, raw.view(dtype).view(meta.shape)))
    return out


def assert_same(
    got: list[tuple[str, torch.Tensor]], want: list[tuple[str, torch.Tensor]], buffer: torch.Tensor
) -> None:
    assert [n for n, _ in got] == [n for n, _ in want]
    storage = buffer.untyped_storage().data_ptr()
    for (name, g), (_, w) in zip(got, want, strict=True):
        assert (g.dtype, g.shape, g.stride(), g.device) == (
            w.dtype,
            w.shape,
            w.stride(),
            w.device,
        ), name
        assert g.is_contiguous(), name
        if w.numel() == 0:
            continue
        # A view stays a view of the received buffer (at the same byte), a copy stays a copy.
        aliases = w.untyped_storage().data_ptr() == storage
        assert (g.untyped_storage().data_ptr() == storage) == aliases, name
        if aliases:
            assert g.data_ptr() == w.data_ptr(), name
        assert torch.equal(g.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8)), name


def every_dtype_metas() -> list[ParamMeta]:
    """Each wire dtype as a matrix, a vector and a scalar, with odd-sized uint8 tensors
    between them (so wider dtypes land on unaligned offsets) and zero-size ones."""
    metas: list[ParamMeta] = []
    for i, name in enumerate(SUPPORTED_DTYPES):
        metas += [
            ParamMeta(f"l{i}.w", name, (3, 2)),
            ParamMeta(f"l{i}.pad", "uint8", (i % 3 + 1,)),
            ParamMeta(f"l{i}.b", name, (5,)),
            ParamMeta(f"l{i}.s", name, ()),
            ParamMeta(f"l{i}.empty", name, (0, 4)),
            ParamMeta(f"l{i}.ones", name, (1, 3, 1)),
        ]
    return metas


def random_buffer(nbytes: int, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8))


def test_every_wire_dtype_matches_the_reference_unpacking() -> None:
    metas = every_dtype_metas()
    (chunk,) = plan(metas, packed=True, buffer_size_bytes=1 << 20)
    assert any(
        o % torch_dtype(m.dtype).itemsize for m, o in zip(metas, chunk.offsets, strict=True)
    )  # unaligned ones
    buf = random_buffer(chunk.nbytes)
    layout = UnpackPlan(metas, chunk)
    assert len(layout) == len(metas) and layout.nbytes == chunk.nbytes
    assert_same(layout.unpack(buf), reference_unpack(buf, metas, chunk), buf)
    assert_same(unpack_chunk(buf, metas, chunk), reference_unpack(buf, metas, chunk), buf)


def test_a_chunks_misaligned_tensors_are_copied_out_together_each_aligned() -> None:
    """A chunk's tensors that cannot be viewed in place are copied out in one copy (one
    launch on a GPU, not one per tensor: a delta round's chunk has one misaligned
    ``@index`` per odd-sized ``@values`` before it), each at a multiple of its itemsize."""
    metas = every_dtype_metas()
    (chunk,) = plan(metas, packed=True, buffer_size_bytes=1 << 20)
    buf = random_buffer(chunk.nbytes)
    got = dict(UnpackPlan(metas, chunk).unpack(buf))
    copied = [
        got[m.name]
        for m, o in zip(metas, chunk.offsets, strict=True)
        if m.nbytes and o % torch_dtype(m.dtype).itemsize
    ]
    assert len({t.element_size() for t in copied}) > 1  # several widths among them
    assert len({t.untyped_storage().data_ptr() for t in copied}) == 1
    assert copied[0].untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()
    assert all(t.data_ptr() % t.element_size() == 0 for t in copied)


@pytest.mark.parametrize("buffer_size", [1, 7, 40, 128])
def test_every_chunk_of_a_round_including_middle_ones(buffer_size: int) -> None:
    metas = every_dtype_metas()
    chunks = plan(metas, packed=True, buffer_size_bytes=buffer_size)
    assert len(chunks) > 2
    for k, chunk in enumerate(chunks):
        buf = random_buffer(
            chunk.nbytes + 13, seed=k
        )  # a link's buffer may be larger than its chunk
        assert_same(UnpackPlan(metas, chunk).unpack(buf), reference_unpack(buf, metas, chunk), buf)


def test_unpacked_framing_one_tensor_per_chunk() -> None:
    metas = every_dtype_metas()
    for chunk in plan(metas, packed=False, buffer_size_bytes=1):
        buf = random_buffer(chunk.nbytes, seed=chunk.start)
        assert_same(UnpackPlan(metas, chunk).unpack(buf), reference_unpack(buf, metas, chunk), buf)


def test_a_buffer_that_starts_inside_its_storage() -> None:
    """``as_strided`` offsets are absolute in the storage: a buffer that is itself a
    slice (at an offset every dtype accepts) must still yield its own bytes."""
    metas = every_dtype_metas()
    (chunk,) = plan(metas, packed=True, buffer_size_bytes=1 << 20)
    whole = random_buffer(chunk.nbytes + 24)
    buf = whole[16 : 16 + chunk.nbytes]
    assert buf.storage_offset() == 16
    assert_same(UnpackPlan(metas, chunk).unpack(buf), reference_unpack(buf, metas, chunk), buf)


def test_values_match_the_packed_arrays() -> None:
    """End to end against the numpy framing: what was packed is what comes out."""
    rng = np.random.default_rng(3)
    metas = [
        ParamMeta("a", "uint8", (3,)),
        ParamMeta("b", "float32", (2, 3)),
        ParamMeta("c", "int64", ()),
        ParamMeta("d", "float16", (4,)),
        ParamMeta("e", "bool", (2, 2)),
    ]
    arrays = [rng.integers(0, 256, m.nbytes, dtype=np.uint8) for m in metas]
    (chunk,) = plan(metas, packed=True, buffer_size_bytes=1 << 10)
    buf = torch.from_numpy(pack_host(arrays, chunk).copy())
    got = UnpackPlan(metas, chunk).unpack(buf)
    for (_, t), a in zip(got, arrays, strict=True):
        assert t.reshape(-1).view(torch.uint8).numpy().tobytes() == a.tobytes()


def test_one_plan_serves_every_round() -> None:
    metas = every_dtype_metas()
    (chunk,) = plan(metas, packed=True, buffer_size_bytes=1 << 20)
    layout = UnpackPlan(metas, chunk)
    for seed in range(3):
        buf = random_buffer(chunk.nbytes, seed=seed)
        assert_same(layout.unpack(buf), reference_unpack(buf, metas, chunk), buf)


def test_bad_buffers_are_refused() -> None:
    metas = [ParamMeta("w", "float32", (2,))]
    (chunk,) = plan(metas, packed=True, buffer_size_bytes=64)
    layout = UnpackPlan(metas, chunk)
    for bad in (
        torch.zeros(7, dtype=torch.uint8),
        torch.zeros(2, dtype=torch.float32),
        torch.zeros(2, 8, dtype=torch.uint8),
    ):
        with pytest.raises(ValueError, match="1-D uint8 of >= 8 bytes"):
            layout.unpack(bad)


# -- the plan cache ------------------------------------------------------------------------------


def update_of(metas: list[ParamMeta]) -> UpdateInfo:
    return UpdateInfo.from_dict(UpdateInfo.from_metas(metas).to_dict())


def test_meta_cache_plans_once_per_metadata() -> None:
    cache, model = MetaCache("test"), object()
    metas = every_dtype_metas()
    with pytest.raises(ValueError, match="has received no round since init"):
        cache.resolve(model, UpdateInfo(), packed=True, buffer_size_bytes=64)
    first = cache.resolve(model, update_of(metas), packed=True, buffer_size_bytes=64)
    assert first.metas == metas and first.chunks == plan(metas, packed=True, buffer_size_bytes=64)
    assert [len(p) for p in first.unpack] == [len(c) for c in first.chunks]
    assert (
        cache.resolve(model, UpdateInfo(), packed=True, buffer_size_bytes=64) is first
    )  # the reuse shorthand
    assert (
        cache.resolve(model, update_of(metas), packed=True, buffer_size_bytes=64) is first
    )  # spelled out again
    changed = [*metas[:-1], ParamMeta(metas[-1].name, metas[-1].dtype, (2, 3, 1))]
    other = cache.resolve(model, update_of(changed), packed=True, buffer_size_bytes=64)
    assert other is not first and other.metas == changed
    assert cache.resolve(model, update_of(changed), packed=True, buffer_size_bytes=128) is not other
    assert (
        cache.resolve(object(), UpdateInfo.from_metas(changed), packed=True, buffer_size_bytes=64)
        is not other
    )


class ListLink(ChunkedLink):
    """Hands out prepared chunk buffers; records the order of posts and waits."""

    def __init__(self, buffers: list[torch.Tensor], *, depth: int = 2) -> None:
        super().__init__(device=torch.device("cpu"), timeout_s=5.0, depth=depth)
        self.buffers = buffers
        self.calls: list[tuple[str, int]] = []

    def post(self, index: int, turn: ReceiveTurn) -> None:
        self.calls.append(("post", index))

    def wait(self, index: int) -> torch.Tensor:
        self.calls.append(("wait", index))
        return self.buffers[index]

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_a_chunked_link_posts_ahead_and_unpacks_with_the_turns_plans() -> None:
    metas = every_dtype_metas()
    chunks = plan(metas, packed=True, buffer_size_bytes=40)
    buffers = [random_buffer(c.nbytes, seed=i) for i, c in enumerate(chunks)]
    link = ListLink(buffers)
    turn = ReceiveTurn(0, metas, chunks, [UnpackPlan(metas, c) for c in chunks], packed=True)
    progress = ReceiveProgress()
    got = list(link.receive(turn, progress))
    for pairs, buf, chunk in zip(got, buffers, chunks, strict=True):
        assert_same(pairs, reference_unpack(buf, metas, chunk), buf)
    assert link.calls[:3] == [("post", 0), ("post", 1), ("wait", 0)]
    assert progress.chunk == len(chunks) - 1
    assert progress.nbytes == sum(m.nbytes for m in metas)  # the link counted every chunk


class Store:
    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: Any) -> None:
        for name, tensor in weights:
            self.loaded[name] = tensor.clone()


class CountingSpec:
    def __init__(self, refuse: str | None = None) -> None:
        self.checks = 0
        self.refuse = refuse

    def check(self, metas: Sequence[ParamMeta], *, complete_layers: bool = True) -> None:
        self.checks += 1
        if self.refuse is not None and any(m.name == self.refuse for m in metas):
            raise ValueError(f"{self.refuse!r} is not a tensor of the model")


def make_core(
    spec: CountingSpec, metas: list[ParamMeta]
) -> tuple[_ReceiverCore, Store, list[ListLink]]:
    store = Store()
    (chunk,) = plan(metas, packed=True, buffer_size_bytes=1 << 20)
    links: list[ListLink] = []

    def connect(info: Any, *, rank: int, device: torch.device) -> ReceiveLink:
        links.append(ListLink([random_buffer(chunk.nbytes, seed=len(links))] * 8))
        return links[-1]

    core = local_core(store, connect, spec=lambda: spec)
    core.init(local_init(packed_buffer_size_bytes=1 << 20))
    return core, store, links


def run_round(core: _ReceiverCore, update: dict[str, Any]) -> None:
    core.start()
    core.receive_dict(update)
    core.finish()


def test_the_served_model_check_runs_once_per_metadata_and_still_refuses() -> None:
    metas = [
        ParamMeta("model.layers.0.w", "float32", (2, 2)),
        ParamMeta("model.norm.weight", "bfloat16", (3,)),
    ]
    spec = CountingSpec()
    core, store, links = make_core(spec, metas)
    full = UpdateInfo.from_metas(metas).to_dict()
    for update in (full, full, UpdateInfo().to_dict(), full):
        run_round(core, update)
    assert spec.checks == 1  # metadata repeated in full, or reused, was checked in round 1
    assert set(store.loaded) == {m.name for m in metas}
    assert torch.equal(
        store.loaded["model.norm.weight"].view(torch.uint8), links[0].buffers[0][16:22]
    )

    changed = [*metas, ParamMeta("extra.w", "float32", (1,))]
    spec.refuse = "extra.w"
    core.start()
    with pytest.raises(ValueError, match="'extra.w' is not a tensor of the model"):
        core.receive_dict(
            UpdateInfo.from_metas(changed).to_dict()
        )  # new metadata: checked again, refused
    assert spec.checks == 2 and not core.initialized
    # The next session starts clean: the refused metadata is checked (and refused) again.
    core.init(local_init(packed_buffer_size_bytes=1 << 20))
    core.start()
    with pytest.raises(ValueError, match="'extra.w' is not a tensor of the model"):
        core.receive_dict(UpdateInfo.from_metas(changed).to_dict())
    assert spec.checks == 3
