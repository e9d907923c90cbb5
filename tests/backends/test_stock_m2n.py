"""The ``nccl_m2n`` plan and its torch-free metadata store, without vLLM (vLLM 0.33's own
receiver drives them in ``tests/interop/test_vllm_m2n.py``)."""

from __future__ import annotations

import hashlib
import json
import pickle
import socket
import sys
import threading
import time
from collections import OrderedDict
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.ranks import script_report
from tests.shared import fake_m2n
from weightwire.backends.base import StockRefusal
from weightwire.backends.nccl.m2n_data import NcclM2NDataPlane
from weightwire.backends.nccl.m2n_store import MetadataGroup, MetadataStore, StoreError
from weightwire.backends.nccl.stock_m2n import (
    M2NLayout,
    M2NParam,
    StockM2NSession,
    check_destinations,
    check_gathered,
    check_param,
    complete_digest,
    decode_placements,
    init_info,
    layout_of,
    source_digest,
)
from weightwire.shared.errors import SourceMismatch, TransferError, TransferTimeout
from weightwire.shared.meta import ParamMeta
from weightwire.shared.slices import Box

torch_dist = pytest.importorskip("torch.distributed")


def rows(n: int, parts: int) -> list[Box]:
    return [Box(((r * n // parts, (r + 1) * n // parts), (0, 4))) for r in range(parts)]


def test_a_layout_is_found_for_each_split_nccl_m2n_describes() -> None:
    assert layout_of("w", (8, 4), [Box.whole((8, 4))] * 3) == M2NLayout((3, 1), None)
    assert layout_of("w", (8, 4), rows(8, 4)) == M2NLayout((4, 1), (0, -1))
    # 4 ranks as a 2 x 2 mesh, columns split over the second axis, rows held by both rows
    cols = [Box(((0, 8), (r % 2 * 2, r % 2 * 2 + 2))) for r in range(4)]
    layout = layout_of("w", (8, 4), cols)
    assert layout == M2NLayout((2, 2), (-1, 1))
    assert [layout.box((8, 4), r) for r in range(4)] == cols
    assert layout.resolved() == ((2, 2), (-1, 1))
    assert M2NLayout((3, 1), None).resolved() == ((3, 1), (-1, 0))


@pytest.mark.parametrize(
    "boxes",
    [
        # rows split over one mesh axis and columns over the other: two split axes
        [Box(((r // 2 * 4, r // 2 * 4 + 4), (r % 2 * 2, r % 2 * 2 + 2))) for r in range(4)],
        [Box(((0, 3), (0, 4))), Box(((3, 8), (0, 4)))],  # uneven
        [Box(((4, 8), (0, 4))), Box(((0, 4), (0, 4)))],  # not in rank order
    ],
)
def test_a_split_nccl_m2n_cannot_describe_is_refused_naming_the_tensor(boxes: list[Box]) -> None:
    with pytest.raises(StockRefusal, match=r"'w': its shards \(rank 0: .*evenly, over one axis"):
        layout_of("w", (8, 4), boxes)


@pytest.mark.parametrize(
    ("dtype", "shape", "match"),
    [
        ("bool", (4,), "dtype bool is not one nccl_m2n moves"),
        ("float32", (2, 2, 2, 2), "it has 4 dims; nccl_m2n moves tensors of 1 to 3"),
        ("float32", (), "it has 0 dims"),
        ("float32", (4, 0), r"shape \[4, 0\] has an empty dim"),
    ],
)
def test_what_vllms_m2n_refuses_is_refused_first(
    dtype: str, shape: tuple[int, ...], match: str
) -> None:
    meta = ParamMeta("w", dtype, shape)
    with pytest.raises(StockRefusal, match=match):
        check_param(meta, M2NLayout((1, 1), None), 1)


def test_the_init_info_and_its_digest() -> None:
    a = M2NParam(ParamMeta("a", "bfloat16", (8, 4)), M2NLayout((2, 1), (0, -1)))
    b = M2NParam(ParamMeta("b", "float32", (4,)), M2NLayout((2, 1), None))
    uid = bytes(range(128))
    info = init_info(
        [a, b],
        master_address="10.0.0.1",
        master_port=1234,
        trainer_ranks=2,
        world_size=6,
        dst_mesh_dims=(2, 2),
        unique_id=uid,
    )
    wire = [
        {
            "name": "a",
            "dtype_name": "bfloat16",
            "shape": [8, 4],
            "src_mesh_dims": [2, 1],
            "src_placements": [0, -1],
        },
        {
            "name": "b",
            "dtype_name": "float32",
            "shape": [4],
            "src_mesh_dims": [2, 1],
            "src_placements": None,
        },
    ]
    canonical = json.dumps(
        {"params": wire, "schema_version": 2}, sort_keys=True, separators=(",", ":")
    )
    assert info == {
        "schema_version": 2,
        "master_address": "10.0.0.1",
        "master_port": 1234,
        "nccl_unique_id_b64": __import__("base64").b64encode(uid).decode(),
        "rank_offset": 2,
        "world_size": 6,
        "dst_mesh_dims": [2, 2],
        "source_digest": hashlib.sha256(canonical.encode()).hexdigest(),
        "params": wire,
    }
    assert source_digest([a, b]) == info["source_digest"]
    with pytest.raises(ValueError, match="must cover the 4 workers"):
        init_info([a], master_address="h", master_port=1, trainer_ranks=2, world_size=6,
                  dst_mesh_dims=(1, 2), unique_id=uid)  # fmt: skip


def test_the_placements_broadcast_and_the_destination_checks() -> None:
    got = decode_placements(np.array([[-2, -2], [-1, 1], [-1, 0]], dtype=np.int8), 3)
    assert got == [None, (-1, 1), (-1, 0)]
    with pytest.raises(TransferError, match=r"int32 \[3, 2\], expected int8 \[3, 2\]"):
        decode_placements(np.zeros((3, 2), dtype=np.int32), 3)
    p = M2NParam(ParamMeta("w", "float32", (6, 4)), M2NLayout((1, 1), None))
    check_destinations([p], (1, 2), [(-1, 0)])
    with pytest.raises(ValueError, match=r"splits dim 1 of \[6, 4\] over 3 ranks"):
        check_destinations([p], (1, 3), [(-1, 1)])


def test_a_failed_or_disagreeing_phase_names_the_rank() -> None:
    ok = {"phase": "source", "digest": "d", "declared_digest": "d", "error": None}
    check_gathered("source", [ok, ok], 1)
    bad = dict(ok, digest=None, error="ImportError: nccl-extensions missing")
    with pytest.raises(TransferError, match="source agreement failed.*worker rank 2: ImportError"):
        check_gathered("source", [ok, ok, bad], 1)
    with pytest.raises(TransferError, match="worker rank 1 disagrees with rank 0"):
        check_gathered("source", [ok, dict(ok, digest="e")], 1)
    with pytest.raises(TransferError, match="trainer rank 1: not a source envelope"):
        check_gathered("source", [ok, {"phase": "source"}], 2)


# -- the store, against torch's own TCPStore client ------------------------------------------------


def client(store: MetadataStore, world: int, timeout_s: float = 5) -> Any:
    """A worker's store, as vLLM's ``StatelessProcessGroup.create`` opens it."""
    return torch_dist.TCPStore(
        store.host,
        store.port,
        world_size=world,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
        use_libuv=False,
    )


def test_torch_clients_and_rank_0_exchange_envelopes_through_the_store() -> None:
    store = MetadataStore("127.0.0.1")
    try:
        group = MetadataGroup(store, 3, timeout_s=10)
        seen: dict[int, list[Any]] = {}

        def worker(rank: int) -> None:
            c = client(store, 3)
            c.set(f"broadcast_from/{rank}/0", pickle.dumps({"rank": rank}))
            seen[rank] = [pickle.loads(c.get(f"broadcast_from/{r}/0")) for r in range(3)]
            c.set(f"broadcast_from/{rank}/1", pickle.dumps([rank, b"x", None]))

        threads = [threading.Thread(target=worker, args=(r,)) for r in (1, 2)]
        for t in threads:
            t.start()
        assert group.all_gather_obj({"rank": 0}) == [{"rank": r} for r in range(3)]
        assert group.all_gather_obj("second") == ["second", [1, b"x", None], [2, b"x", None]]
        for t in threads:
            t.join(10)
        assert seen == {r: [{"rank": 0}, {"rank": 1}, {"rank": 2}] for r in (1, 2)}
        c = client(store, 3, timeout_s=0.3)
        with pytest.raises(torch_dist.DistStoreError, match="timeout"):
            c.get("never")  # a client's timeout cancels its wait; the connection stays usable
        assert c.add("n", 2) == 2 and c.add("n", 3) == 5
        assert c.check(["n"]) and not c.check(["never"])
    finally:
        store.close()


def test_an_envelope_that_is_not_plain_data_is_refused_and_a_missing_one_times_out() -> None:
    store = MetadataStore("127.0.0.1")
    try:
        group = MetadataGroup(store, 2, timeout_s=0.5)
        with pytest.raises(TransferTimeout, match="rank 1's envelope.*did not reach this step"):
            group.all_gather_obj("x")
        c = client(store, 2)
        c.set("broadcast_from/1/0", pickle.dumps(OrderedDict(a=1)))
        with pytest.raises(StoreError, match=r"names collections\.OrderedDict; only plain data"):
            group.all_gather_obj("x")
        raw = socket.create_connection((store.host, store.port))  # not a torch client
        raw.sendall(b"\xff" * 16)
        try:
            dropped = raw.recv(1) == b""
        except ConnectionResetError:
            dropped = True
        assert dropped  # the store keeps serving the others
        raw.close()
        c.set("k", b"v")
        assert c.get("k") == b"v"
    finally:
        store.close()


# -- the session's own refusals ------------------------------------------------------------------


class RefusingServer:
    calls: list[str]

    def __init__(self) -> None:
        self.calls = []

    def init_weight_transfer_engine(self, info: dict[str, Any]) -> None:
        self.calls.append("init")
        raise TransferError("HTTP 400: backend nccl_m2n is not configured on this server")

    def start_weight_update(self) -> None:
        self.calls.append("start")


def test_an_init_the_server_refuses_fails_at_once_not_at_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, module in fake_m2n.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    fake_m2n.reset()
    p = M2NParam(ParamMeta("w", "float32", (4, 4)), M2NLayout((1, 1), None))
    server = RefusingServer()
    s = StockM2NSession(
        server,
        [p],
        NcclM2NDataPlane([0], xp=fake_m2n.FakeXP()),
        workers=2,
        host="127.0.0.1",
        unique_id=bytes(128),
        timeout_s=60,
    )
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="not configured"):
        s.open()
    assert time.monotonic() - t0 < 10
    with pytest.raises(TransferError, match="not open"):
        s.send([[np.zeros((4, 4), np.float32)]])
    s.placements = [None]  # as if open: a wrong shard is refused before the start call
    with pytest.raises(SourceMismatch, match=r"'w' on trainer rank 0 is \[4, 2\]; its layout"):
        s.send([[np.zeros((4, 2), np.float32)]])
    assert server.calls == ["init"]


def test_an_fsdp_tp_jax_mesh_is_eight_trainer_ranks_each_sending_its_own_shard() -> None:
    """8 forced host devices (FSDP 4 x TP 2) in a subprocess (XLA_FLAGS precede jax's
    import): the layouts read from the shardings, each rank's shard a single-device view of
    its local shape (no rank handed a whole split tensor), and the reshards through our data
    plane on the fake ``nccl.m2n`` land every worker's TP slices bit-exactly."""
    report = script_report(Path(__file__).with_name("_m2n_jax_mesh.py"))
    assert "'both.weight': its shards (rank 0: [0:2, 0:4], rank 1: [0:2, 4:8]" in report["refused"]
    assert report["whole_held"] == []
    # per worker: half of rows (512 B) and cols (512 B), the 64 B bias and 32 B norm whole
    assert report["received"] == [608, 608]


# -- a whole session, the workers emulated (vLLM's own run in tests/interop/test_vllm_m2n.py) --


class EmulatedWorkers:
    """The worker side of the nccl_m2n protocol, written from its description (module
    docstring of ``stock_m2n``), in threads: each worker joins the store with torch's own
    ``TCPStore`` client, answers the four phases with its envelopes, joins the fake NCCL
    world, the first one broadcasts ``placements``, and each update reshards every name
    into that worker's buffer."""

    def __init__(self, placements: list[tuple[int, int] | None], tp: int) -> None:
        self.placements, self.tp = placements, tp
        self.bufs: dict[int, dict[str, np.ndarray]] = {}
        self.comm: dict[int, Any] = {}
        self.calls: list[str] = []

    def _all(self, call: Any) -> None:
        errors: list[BaseException] = []

        def run(w: int) -> None:
            try:
                call(w)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(w,), daemon=True) for w in range(self.tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        if errors:
            raise errors[0]

    def init_weight_transfer_engine(self, info: dict[str, Any]) -> None:
        self.calls.append("init")
        self.info = info
        t = info["rank_offset"]
        params = [
            M2NParam(
                ParamMeta(p["name"], p["dtype_name"], tuple(p["shape"])),
                M2NLayout(
                    tuple(p["src_mesh_dims"]), p["src_placements"] and tuple(p["src_placements"])
                ),
            )
            for p in info["params"]
        ]
        self.params, self.t = params, t
        uid = __import__("base64").b64decode(info["nccl_unique_id_b64"])

        def join(w: int) -> None:
            rank, world = t + w, info["world_size"]
            store = client_at(info["master_address"], info["master_port"], world)
            n = [0]

            def gather(obj: Any) -> list[Any]:
                store.set(f"broadcast_from/{rank}/{n[0]}", pickle.dumps(obj))
                out = [pickle.loads(store.get(f"broadcast_from/{r}/{n[0]}")) for r in range(world)]
                n[0] += 1
                return out

            digest = hashlib.sha256(
                json.dumps(
                    {"schema_version": 2, "params": info["params"]},
                    sort_keys=True,
                    separators=(",", ":"),
                ).encode()
            ).hexdigest()
            assert digest == info["source_digest"]
            for env in (
                {"phase": "source", "digest": digest, "declared_digest": digest, "error": None},
                {
                    "phase": "data_plane",
                    "mode": "uid",
                    "uid_digest": hashlib.sha256(uid).hexdigest(),
                    "error": None,
                },
                {"phase": "runtime_ready", "error": None},
            ):
                assert all(e == env for e in gather(env))
            comm = fake_m2n.Communicator.init(world, rank, fake_m2n.UniqueId.from_bytes(uid))
            plan = np.array(
                [[-2, -2] if p is None else list(p) for p in self.placements], dtype=np.int8
            )
            comm.broadcast(plan, plan, t)
            whole = complete_digest(digest, tuple(info["dst_mesh_dims"]), t, self.placements)
            env = {"phase": "complete_plan", "digest": whole, "error": None}
            assert all(e == env for e in gather(env))
            self.comm[w] = comm

        self._all(join)

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update: dict[str, Any]) -> None:
        self.calls.append("update")
        handle = fake_m2n.Handle.create()

        def receive(w: int) -> None:
            by_name = {
                p.meta.name: (p, d) for p, d in zip(self.params, self.placements, strict=True)
            }
            out = {}
            for name in update["names"]:
                p, place = by_name[name]
                dst = M2NLayout((1, self.tp), place) if place else M2NLayout((self.tp, 1), None)
                buf = np.zeros(dst.box(p.meta.shape, w).shape, np.float32)
                (sd, sp), (dd, dp) = p.layout.resolved(), dst.resolved()
                fake_m2n.reshard(
                    None, buf, self.comm[w], src_mesh=fake_m2n.Mesh(sd, 0),
                    src_placements=_codes(sp), dst_mesh=fake_m2n.Mesh(dd, self.t),
                    dst_placements=_codes(dp), handle=handle,
                )  # fmt: skip
                out[name] = buf
            self.bufs[w] = out

        self._all(receive)

    def finish_weight_update(self, version: str) -> None:
        self.calls.append(f"finish {version}")


def _codes(codes: tuple[int, int]) -> list[Any]:
    return [fake_m2n.Replicate() if c < 0 else fake_m2n.Shard(c) for c in codes]


def client_at(host: str, port: int, world: int) -> Any:
    return torch_dist.TCPStore(
        host, port, world_size=world, is_master=False, timeout=timedelta(seconds=10),
        use_libuv=False,
    )  # fmt: skip


def test_a_session_opens_and_sends_rounds_each_worker_its_part(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, module in fake_m2n.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    fake_m2n.reset()
    shapes = {"rows": (8, 4), "cols": (4, 8), "norm": (4,)}
    rowsplit = [Box(((r * 4, r * 4 + 4), (0, 4))) for r in range(2)]
    boxes = {"rows": rowsplit, "cols": [Box.whole((4, 8))] * 2, "norm": [Box.whole((4,))] * 2}
    params = [
        M2NParam(ParamMeta(n, "float32", s), layout_of(n, s, boxes[n])) for n, s in shapes.items()
    ]
    workers = EmulatedWorkers([(-1, 0), (-1, 1), None], tp=2)
    s = StockM2NSession(
        workers,
        params,
        NcclM2NDataPlane([0, 1], xp=fake_m2n.FakeXP()),
        workers=2,
        host="127.0.0.1",
        unique_id=bytes(range(128)),
        dst_mesh_dims=(1, 2),
        timeout_s=20,
    )
    try:
        s.open()
        assert s.placements == [(-1, 0), (-1, 1), None]
        rng = np.random.default_rng(0)
        for version in ("1", "2"):
            full = {n: rng.standard_normal(sh).astype(np.float32) for n, sh in shapes.items()}
            shards = [
                [full[p.meta.name][p.layout.box(p.meta.shape, r).slices()] for r in range(2)]
                for p in params
            ]
            s.send(shards, version)
            for w in range(2):
                got = workers.bufs[w]
                np.testing.assert_array_equal(got["rows"], full["rows"][w * 4 : w * 4 + 4])
                np.testing.assert_array_equal(got["cols"], full["cols"][:, w * 4 : w * 4 + 4])
                np.testing.assert_array_equal(got["norm"], full["norm"])
        assert workers.calls == ["init"] + ["start", "update", "finish 1"] + [
            "start",
            "update",
            "finish 2",
        ]
    finally:
        s.close()
        fake_m2n.reset()


def test_communicators_formed_after_the_init_wait_gave_up_are_aborted() -> None:
    """``connect`` times out while ``ncclCommInitRank`` still blocks; when it returns later,
    the init thread aborts what it formed (no communicator is left behind)."""
    import contextlib
    import threading
    import time
    from types import SimpleNamespace

    from weightwire.backends.nccl.m2n_data import NcclM2NDataPlane
    from weightwire.shared.errors import TransferTimeout

    formed: list[SimpleNamespace] = []
    release = threading.Event()

    def init(*, nranks: int, rank: int, unique_id: object) -> SimpleNamespace:
        release.wait(10)  # the workers join only after the trainer's wait gave up
        comm = SimpleNamespace(aborted=False)
        comm.abort = lambda: setattr(comm, "aborted", True)
        formed.append(comm)
        return comm

    core = SimpleNamespace(
        UniqueId=SimpleNamespace(from_bytes=lambda b: b),
        Communicator=SimpleNamespace(init=init),
        group_start=lambda: None,
        group_end=lambda: None,
    )
    xp = SimpleNamespace(cuda=SimpleNamespace(Device=lambda d: contextlib.nullcontext()))
    data = NcclM2NDataPlane([0, 1], xp=xp)
    data._core = core
    with pytest.raises(TransferTimeout, match="did not form within"):
        data.connect(3, b"uid", timeout_s=0.2)
    release.set()
    deadline = time.monotonic() + 5
    while len(formed) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert len(formed) == 2 and all(c.aborted for c in formed)
    assert data._comms == []
