"""``NcclM2NDataPlane`` on two GPUs with the real ``nccl.m2n`` (NVIDIA's nccl-extensions).

Trainer rank 0 (GPU 0, our data plane, CuPy buffers) and one receiving rank (GPU 1, a thread
issuing the calls vLLM 0.33's ``M2NWeightTransferEngine`` issues: ``Communicator.init``, the
placements broadcast from the first worker, one ``nccl.m2n.reshard`` per tensor into its
buffer). Skips without two GPUs, CuPy or ``nccl-extensions``.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import numpy as np
import pytest

from weightwire.backends.nccl.stock_m2n import M2NLayout

pytestmark = pytest.mark.gpu(count=2)


def test_a_trainer_tensor_lands_on_a_peer_gpu_through_nccl_m2n() -> None:
    cp = pytest.importorskip("cupy")
    core = pytest.importorskip("nccl.core")
    m2n = pytest.importorskip("nccl.m2n")
    from weightwire.backends.nccl.m2n_data import NcclM2NDataPlane

    uid = bytes(core.get_unique_id().as_bytes)
    whole = np.arange(64, dtype=np.float32).reshape(8, 8)
    got: dict[str, Any] = {}

    def worker() -> None:  # world rank 1, the only worker: a (1, 1) destination mesh
        try:
            with cp.cuda.Device(1):
                handle = m2n.Handle.create(m2n.Config(max_cta=None))
                comm = core.Communicator.init(
                    nranks=2, rank=1, unique_id=core.UniqueId.from_bytes(uid)
                )
                stream = cp.cuda.Stream(non_blocking=True)
                plan = cp.asarray(np.array([[-2, -2], [-1, 1]], dtype=np.int8))
                comm.broadcast(plan, plan, 1, stream=int(stream.ptr))
                bufs = [cp.zeros((8, 8), cp.float32), cp.zeros((8, 8), cp.float32)]
                for buf, dst in zip(bufs, (((1, 1), (-1, 0)), ((1, 1), (-1, 1))), strict=True):
                    m2n.reshard(
                        None,
                        buf,
                        comm,
                        int(stream.ptr),
                        src_mesh=m2n.Mesh((1, 1), start_rank=0),
                        src_placements=[m2n.Replicate(), m2n.Shard(0)],
                        dst_mesh=m2n.Mesh(dst[0], start_rank=1),
                        dst_placements=[m2n.Replicate(), m2n.Shard(dst[1][1])],
                        handle=handle,
                    )
                stream.synchronize()
                got["bufs"] = [cp.asnumpy(b) for b in bufs]
                handle.destroy()
                comm.abort()
        except BaseException as exc:
            got["error"] = exc

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    data = NcclM2NDataPlane([0])
    try:
        data.prepare()
        data.connect(2, uid, timeout_s=60)
        rows = data.placements(2, 1, timeout_s=60)
        assert rows.tolist() == [[-2, -2], [-1, 1]]
        with cp.cuda.Device(0):
            src = cp.asarray(whole)
        for dst in (M2NLayout((1, 1), None).resolved(), M2NLayout((1, 1), (-1, 1)).resolved()):
            data.reshard([src], M2NLayout((1, 1), None).resolved(), dst, 1)
        data.wait(timeout_s=60)
    finally:
        t.join(60)
        data.close()
    assert "error" not in got, got.get("error")
    for buf in got["bufs"]:  # a one-worker mesh: whole, as a fallback and as a TP split of 1
        np.testing.assert_array_equal(buf, whole)


class _GpuWorker:
    """One vLLM ``nccl_m2n`` worker on GPU 1 behind the four round calls: the store phases
    with torch's own ``TCPStore`` client (as ``test_stock_m2n.EmulatedWorkers``), then the real
    ``Communicator.init``, the placements broadcast and one ``nccl.m2n.reshard`` per name
    into CuPy buffers, as vLLM's ``M2NWeightTransferEngine`` issues them."""

    def __init__(self, cp: Any, core: Any, m2n: Any) -> None:
        self.cp, self.core, self.m2n = cp, core, m2n
        self.bufs: dict[str, np.ndarray] = {}
        self.calls: list[str] = []

    def init_weight_transfer_engine(self, info: dict[str, Any]) -> None:
        import base64
        import hashlib
        import pickle

        from tests.backends.test_stock_m2n import client_at

        self.calls.append("init")
        cp, core, m2n = self.cp, self.core, self.m2n
        t, world = info["rank_offset"], info["world_size"]
        uid = base64.b64decode(info["nccl_unique_id_b64"])
        store = client_at(info["master_address"], info["master_port"], world)
        n = [0]

        def gather(obj: Any) -> list[Any]:
            store.set(f"broadcast_from/{t}/{n[0]}", pickle.dumps(obj))
            out = [pickle.loads(store.get(f"broadcast_from/{r}/{n[0]}")) for r in range(world)]
            n[0] += 1
            return out

        digest = info["source_digest"]
        gather({"phase": "source", "digest": digest, "declared_digest": digest, "error": None})
        gather(
            {
                "phase": "data_plane",
                "mode": "uid",
                "uid_digest": hashlib.sha256(uid).hexdigest(),
                "error": None,
            }
        )
        with cp.cuda.Device(1):
            self.handle = m2n.Handle.create(m2n.Config(max_cta=None))
            self.stream = cp.cuda.Stream(non_blocking=True)
            gather({"phase": "runtime_ready", "error": None})
            self.comm = core.Communicator.init(
                nranks=world, rank=t, unique_id=core.UniqueId.from_bytes(uid)
            )
            plan = cp.asarray(np.full((len(info["params"]), 2), -2, dtype=np.int8))
            self.comm.broadcast(plan, plan, t, stream=int(self.stream.ptr))
            self.stream.synchronize()
        from weightwire.backends.nccl.stock_m2n import complete_digest

        whole = complete_digest(digest, (1, 1), t, [None] * len(info["params"]))
        gather({"phase": "complete_plan", "digest": whole, "error": None})
        self.params = {p["name"]: p for p in info["params"]}
        self.t = t

    def start_weight_update(self) -> None:
        self.calls.append("start")

    def update_weights(self, update: dict[str, Any]) -> None:
        cp, m2n = self.cp, self.m2n
        self.calls.append("update")
        with cp.cuda.Device(1):
            for name in update["names"]:
                p = self.params[name]
                buf = cp.zeros(tuple(p["shape"]), cp.float32)
                sd, sp = p["src_mesh_dims"], p["src_placements"] or [-1, 0]
                m2n.reshard(
                    None,
                    buf,
                    self.comm,
                    int(self.stream.ptr),
                    src_mesh=m2n.Mesh(tuple(sd), start_rank=0),
                    src_placements=[m2n.Replicate() if c < 0 else m2n.Shard(c) for c in sp],
                    dst_mesh=m2n.Mesh((1, 1), start_rank=self.t),
                    dst_placements=[m2n.Replicate(), m2n.Shard(0)],
                    handle=self.handle,
                )
                self.stream.synchronize()
                self.bufs[name] = cp.asnumpy(buf)

    def finish_weight_update(self, version: str) -> None:
        self.calls.append(f"finish {version}")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.handle.destroy()
            self.comm.abort()


def test_the_torch_engine_sends_nccl_m2n_rounds_from_a_gpu() -> None:
    """``TrainerInitInfo(backend="nccl_m2n")`` with CUDA torch tensors on GPU 0: the engine's
    round reshards each tensor (its ``__cuda_array_interface__``) into a worker on GPU 1."""
    cp = pytest.importorskip("cupy")
    core = pytest.importorskip("nccl.core")
    m2n = pytest.importorskip("nccl.m2n")
    torch = pytest.importorskip("torch")
    from weightwire.testing.sources import DictSource
    from weightwire.torch_side.dtypes import wire_name
    from weightwire.torch_side.sender.engine import TorchTrainerEngine
    from weightwire.trainer.config import TrainerInitInfo

    worker = _GpuWorker(cp, core, m2n)
    shapes = {"a.weight": (64, 32), "b.weight": (128,)}
    g = torch.Generator(device="cuda:0").manual_seed(0)
    source = DictSource(
        {n: torch.randn(s, device="cuda:0", generator=g) for n, s in shapes.items()},
        lambda t: (wire_name(t.dtype), tuple(t.shape)),
    )
    info = TrainerInitInfo(
        backend="nccl_m2n",
        server_version="0.33.0",
        inference_world_size=1,
        pause_mode=None,
        reset_prefix_cache=False,
    )
    engine = TorchTrainerEngine.trainer_init(info, client=worker, source=source)
    try:
        for version in ("1", "2"):
            source.tensors = {
                n: torch.randn(s, device="cuda:0", generator=g) for n, s in shapes.items()
            }
            engine.send_weights(version)
            for name, t in source.tensors.items():
                np.testing.assert_array_equal(worker.bufs[name], t.cpu().numpy())
        assert worker.calls == ["init"] + ["start", "update", "finish 1"] + [
            "start",
            "update",
            "finish 2",
        ]
    finally:
        engine.shutdown()
        worker.close()
