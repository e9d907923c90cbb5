"""The data plane of a stock ``nccl_m2n`` session: NVIDIA's ``nccl.m2n`` on NCCL4Py, torch-free.

The trainer ranks of this process sit on ``devices`` (rank r on ``devices[r]``, r in
``[0, T)``). Per rank: one M2N handle, one stream and one NCCL4Py communicator of the
shared world (trainer ranks and vLLM workers, one unique id); calls for several local ranks
go in one NCCL / M2N group (one host thread). Buffers are anything with a CUDA Array
Interface: CuPy arrays, single-device JAX arrays. Every wait polls with a deadline: NCCL
has no timeout of its own, so a peer that never arrives ends in ``TransferTimeout`` and
the communicators are aborted, never a hang.

Install on the trainer: ``pip install nccl-extensions[cu12]`` (or ``[cu13]``), which brings
``nccl4py`` and NCCL >= 2.30.5; the workers need the same package (vLLM does not install it)
and the same NCCL version.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from weightwire.backends.nccl.library import NCCLUnavailable
from weightwire.backends.nccl.stock_m2n import REPLICATE, WHOLE_ROW
from weightwire.shared.errors import TransferError, TransferTimeout
from weightwire.shared.waiting import poll_until

Mesh = tuple[tuple[int, int], tuple[int, int]]
"""A side of one reshard as ``nccl.m2n`` takes it: (mesh dims, per-axis placement codes)."""


def load_m2n() -> tuple[Any, Any]:
    """``(nccl.core, nccl.m2n)`` or ``NCCLUnavailable`` naming the package."""
    try:
        import nccl.core as core
        import nccl.m2n as m2n
    except Exception as exc:  # ImportError, or a CUDA library that does not load
        raise NCCLUnavailable(
            "the nccl_m2n backend needs NVIDIA's nccl-extensions (nccl.m2n) and nccl4py with "
            "NCCL >= 2.30.5 on the trainer, as on the vLLM workers: pip install "
            f"'nccl-extensions[cu12]' (or [cu13]); import failed: {exc}"
        ) from exc
    return core, m2n


def array_module() -> Any:
    """CuPy, the data plane's devices and streams (optional dependency, GPU hosts only; the
    CPU tests put a fake in its place)."""
    import cupy

    return cupy


def mint_m2n_unique_id() -> bytes:
    """A fresh 128-byte ``ncclUniqueId`` from NCCL4Py (a secret, as any unique id)."""
    core, _ = load_m2n()
    return bytes(core.get_unique_id().as_bytes)


class NcclM2NDataPlane:
    """Trainer ranks ``[0, len(devices))`` of one process (see the module docstring)."""

    def __init__(
        self, devices: Sequence[int], *, max_cta: int | None = None, xp: Any = None
    ) -> None:
        if not devices:
            raise ValueError("an nccl_m2n data plane needs at least one trainer device")
        self.devices = [int(d) for d in devices]
        self.max_cta = max_cta
        self._xp = xp
        self._core: Any = None
        self._m2n: Any = None
        self._handles: list[Any] = []
        self._streams: list[Any] = []
        self._comms: list[Any] = []

    @property
    def ranks(self) -> int:
        return len(self.devices)

    def prepare(self) -> None:
        """The rank-local resources, before any NCCL call (the ``runtime_ready`` phase)."""
        self._core, self._m2n = load_m2n()
        if self._xp is None:
            self._xp = array_module()
        xp, m2n = self._xp, self._m2n
        for d in self.devices:
            with xp.cuda.Device(d):
                self._handles.append(m2n.Handle.create(m2n.Config(max_cta=self.max_cta)))
                self._streams.append(xp.cuda.Stream(non_blocking=True))

    def connect(
        self,
        world_size: int,
        unique_id: bytes,
        *,
        timeout_s: float,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Every local rank's ``ncclCommInitRank`` (blocking until the workers joined too),
        in a helper thread so that the wait is bounded; ``check`` raises to end it sooner
        (the init call failed)."""
        core, xp = self._core, self._xp
        uid = core.UniqueId.from_bytes(unique_id)
        box: dict[str, Any] = {}
        lock, abandoned = threading.Lock(), threading.Event()

        def init() -> None:
            try:
                comms = []
                core.group_start()
                try:
                    for r, d in enumerate(self.devices):
                        with xp.cuda.Device(d):
                            comms.append(
                                core.Communicator.init(nranks=world_size, rank=r, unique_id=uid)
                            )
                finally:
                    core.group_end()
                with lock:
                    box["comms"] = comms
                    late = abandoned.is_set()
                if late:  # the wait gave up: communicators formed after it are released
                    for comm in comms:
                        with contextlib.suppress(Exception):
                            comm.abort()
            except BaseException as exc:
                box["error"] = exc

        t = threading.Thread(target=init, name="m2n-comm-init", daemon=True)
        t.start()
        deadline = time.monotonic() + timeout_s
        try:
            while t.is_alive() and time.monotonic() < deadline:
                t.join(0.05)
                if check is not None and t.is_alive():
                    check()
        except BaseException:
            self._abandon(lock, abandoned, box)
            raise
        if t.is_alive():
            self._abandon(lock, abandoned, box)
            raise TransferTimeout(
                f"the nccl_m2n communicator did not form within {timeout_s:.0f}s: a worker did "
                "not join ncclCommInitRank (NCCL versions differ, or the workers failed: see "
                "their log)"
            )
        if "error" in box:
            raise TransferError(f"ncclCommInitRank failed: {box['error']}") from box["error"]
        self._comms = box["comms"]

    @staticmethod
    def _abandon(lock: threading.Lock, abandoned: threading.Event, box: dict[str, Any]) -> None:
        """The init wait gave up: the init thread releases what it forms later; what it
        already formed is released here."""
        with lock:
            abandoned.set()
            formed = box.get("comms", [])
        for comm in formed:
            with contextlib.suppress(Exception):  # tearing down: the failure is being raised
                comm.abort()

    def placements(
        self, n: int, root: int, *, timeout_s: float, check: Callable[[], None] | None = None
    ) -> np.ndarray:
        """The first worker's broadcast of the destination placements, as every local rank
        receives it (rank 0's copy, on the host)."""
        xp, core = self._xp, self._core
        bufs = []
        for d, stream in zip(self.devices, self._streams, strict=True):
            with xp.cuda.Device(d), stream:  # filled on the broadcast's own stream: ordered
                bufs.append(xp.full((n, 2), WHOLE_ROW, dtype=xp.int8))
        core.group_start()
        try:
            for comm, buf, stream in zip(self._comms, bufs, self._streams, strict=True):
                comm.broadcast(buf, buf, root, stream=int(stream.ptr))
        finally:
            core.group_end()
        self.wait(timeout_s=timeout_s, what="the workers' placements broadcast", check=check)
        return np.asarray(xp.asnumpy(bufs[0]))

    def reshard(self, shards: Sequence[Any], src: Mesh, dst: Mesh, first_worker: int) -> None:
        """One tensor: each local rank's shard (``shards[r]``) into the workers' layout."""
        m2n = self._m2n

        def placements(codes: tuple[int, int]) -> list[Any]:
            return [m2n.Replicate() if c == REPLICATE else m2n.Shard(c) for c in codes]

        src_mesh, dst_mesh = (
            m2n.Mesh(src[0], start_rank=0),
            m2n.Mesh(dst[0], start_rank=first_worker),
        )
        with m2n.group():
            for r, shard in enumerate(shards):
                m2n.reshard(
                    shard,
                    None,
                    self._comms[r],
                    int(self._streams[r].ptr),
                    src_mesh=src_mesh,
                    src_placements=placements(src[1]),
                    dst_mesh=dst_mesh,
                    dst_placements=placements(dst[1]),
                    handle=self._handles[r],
                )

    def wait(
        self,
        *,
        timeout_s: float,
        what: str = "the round's reshards",
        check: Callable[[], None] | None = None,
    ) -> None:
        """Until every local stream drained; at the deadline the communicators are aborted
        (a stuck collective never returns otherwise) and ``TransferTimeout`` is raised.
        ``check`` (it raises: the workers' update call failed) ends the wait sooner, the
        communicators aborted too."""

        def expired() -> BaseException:
            self.abort()
            return TransferTimeout(
                f"{what} did not complete within {timeout_s:.0f}s (a worker left the "
                "collective, or never entered it: see the workers' log); the communicator "
                "was aborted, open a new session"
            )

        try:
            poll_until(
                lambda: all(s.done for s in self._streams),
                deadline=time.monotonic() + timeout_s,
                expired=expired,
                check=check,
                check_every_s=0.05,
            )
        except TransferTimeout:
            raise
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        comms, self._comms = self._comms, []
        for comm in comms:
            with contextlib.suppress(Exception):  # tearing down: the failure was raised
                comm.abort()

    def close(self) -> None:
        self.abort()  # first: nothing queued still runs on the handles destroyed next
        handles, self._handles = self._handles, []
        for h in handles:
            with contextlib.suppress(Exception):  # tearing down
                h.destroy()
        self._streams = []
