"""``NcclM2NDataPlane`` on two GPUs with the real ``nccl.m2n`` (NVIDIA's nccl-extensions).

Trainer rank 0 (GPU 0, our data plane, CuPy buffers) and one receiving rank (GPU 1, a thread
issuing the calls vLLM 0.33's ``M2NWeightTransferEngine`` issues: ``Communicator.init``, the
placements broadcast from the first worker, one ``nccl.m2n.reshard`` per tensor into its
buffer). Skips without two GPUs, CuPy or ``nccl-extensions``.
"""

from __future__ import annotations

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
