"""A collective fake of one NCCL group, for several broadcasters on CPU (issue 20).

``FakeWorld`` matches the n-th collective of every member, like NCCL: a member's
broadcast returns only once every member of the world has entered the same
collective (with the same root and size), so a member that skips one (forgets to
discard another broadcaster's turn) leaves the others waiting until their timeout,
and the test fails with that ``TransferTimeout`` instead of passing. An aborted member
fails its own calls; the others find out through their timeouts, as with NCCL.

``FakeGroupBackend`` (``caps.several == "group"``) hands rank 0, the other
broadcasters (``join_peer``) and the fake workers members of one world;
``FakeWorkers`` answers a ``FakeServer``'s init / update routes by receiving each turn
from its ``src`` and recording every tensor's sha256 per worker.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np

from tests.trainer.fakes import FakeServer
from weightwire.backends import register_backend
from weightwire.backends.base import (
    Backend,
    DevicePacker,
    Rendezvous,
    RoundSender,
    SenderCaps,
    SenderParts,
)
from weightwire.backends.pipelines import DevicePipeline
from weightwire.shared.errors import TransferError, TransferTimeout
from weightwire.shared.framing import plan
from weightwire.shared.meta import ParamMeta


def as_bytes(buffer: Any) -> np.ndarray:
    return np.ascontiguousarray(buffer).reshape(-1).view(np.uint8)


class FakeWorld:
    _ids = itertools.count()
    worlds: ClassVar[dict[int, FakeWorld]] = {}

    def __init__(self, size: int) -> None:
        self.size = size
        self.id = next(self._ids)
        self.worlds[self.id] = self
        self.cv = threading.Condition()
        self.seq = [0] * size
        self.calls: dict[int, dict[int, tuple[str, int, int, Any]]] = {}
        self.data: dict[int, bytes] = {}
        self.errors: dict[int, str] = {}
        self.aborted: set[int] = set()
        self.roots: list[int] = []  # the root of every completed broadcast, in order

    def member(self, rank: int) -> FakeMember:
        return FakeMember(self, rank)

    def collective(
        self, rank: int, kind: str, buffer: Any, root: int, timeout: float | None
    ) -> None:
        with self.cv:
            if rank in self.aborted:
                raise TransferError(f"fake NCCL rank {rank} is aborted")
            k = self.seq[rank]
            self.seq[rank] += 1
            nbytes = (
                0
                if buffer is None
                else sum(
                    as_bytes(p).nbytes for p in (buffer if isinstance(buffer, list) else [buffer])
                )
            )
            calls = self.calls.setdefault(k, {})
            calls[rank] = (kind, root, nbytes, buffer)
            if len(calls) == self.size:
                shapes = {(c[0], c[1], c[2]) for c in calls.values()}
                if len(shapes) != 1:  # every member of the collective fails alike
                    self.errors[k] = f"fake NCCL collective {k}: members disagree: {sorted(shapes)}"
                    self.data[k] = b""
                    self.cv.notify_all()
                if kind == "broadcast":
                    src = calls[root][3]
                    parts = src if isinstance(src, list) else [src]
                    self.data[k] = b"".join(as_bytes(p).tobytes() for p in parts)
                    self.roots.append(root)
                else:
                    self.data[k] = b""
                self.cv.notify_all()
            elif not self.cv.wait_for(
                lambda: k in self.data or rank in self.aborted, timeout=timeout or 30
            ):
                missing = sorted(set(range(self.size)) - set(calls))
                raise TransferTimeout(
                    f"fake NCCL rank {rank}: collective {k} ({kind}, root {root}) waited "
                    f"{timeout:g} s for ranks {missing}"
                )
            if rank in self.aborted:
                raise TransferError(f"fake NCCL rank {rank} was aborted during collective {k}")
            if k in self.errors:
                raise TransferError(self.errors[k])
            got = self.data[k]
            if kind == "broadcast" and rank != root:
                if len(got) != nbytes:
                    raise TransferError(
                        f"fake NCCL collective {k}: root sent {len(got)} bytes, "
                        f"rank {rank} posted {nbytes}"
                    )
                as_bytes(buffer)[:] = np.frombuffer(got, np.uint8)


class FakeMember:
    """One rank of a ``FakeWorld``; implements ``DeviceCommunicator``."""

    def __init__(self, world: FakeWorld, rank: int) -> None:
        self.world, self._rank = world, rank
        self.closed = False

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self.world.size

    def warmup(self, *, timeout: float | None = None) -> None:
        self.world.collective(self._rank, "allreduce", None, 0, timeout)

    def broadcast(
        self, buffer: Any, *, root: int = 0, timeout: float | None = None, stream: Any = None
    ) -> None:
        self.world.collective(self._rank, "broadcast", buffer, root, timeout)

    def broadcast_typed(
        self,
        buffer: Any,
        *,
        nccl_dtype: int,
        count: int,
        root: int = 0,
        timeout: float | None = None,
        stream: Any = None,
    ) -> None:
        self.world.collective(self._rank, "broadcast", buffer, root, timeout)

    def synchronize(self, stream: Any, *, timeout: float) -> None:
        if self._rank in self.world.aborted:
            raise TransferError(f"fake NCCL rank {self._rank} is aborted")

    def abort(self) -> None:
        with self.world.cv:
            self.world.aborted.add(self._rank)
            self.world.cv.notify_all()

    def close(self) -> None:
        self.closed = True


class FakePacker(DevicePacker):
    """Host arrays standing in for device buffers."""

    ordinal = 0

    def new_stream(self) -> Any:
        return object()

    def regions(self, tensors: Sequence[Any], stream: Any) -> list[Any]:
        return [as_bytes(t).copy() for t in tensors]


class FakeSlots:
    """Host stand-in for ``backends.device.SlotBuffers``."""

    def gather(self, slot: int, parts: Sequence[Any], nbytes: int, stream: Any) -> Any:
        out = np.concatenate(list(parts)) if parts else np.empty(0, np.uint8)
        assert out.nbytes == nbytes
        return out

    def slot(self, slot: int, nbytes: int) -> Any:
        return np.empty(nbytes, np.uint8)

    def settled(self, slot: int) -> None:
        return None

    def release(self) -> None:
        return None


class FakeGroupBackend(Backend):
    name: ClassVar[str] = "fake_group"
    caps: ClassVar[SenderCaps] = SenderCaps(on_device=True, several="group")

    def open(self, info: Any, *, world_size: int) -> Rendezvous:
        world = FakeWorld(world_size)

        class _Rdv(Rendezvous):
            def join(self, *, timeout: float) -> Any:
                return world.member(0)

        return _Rdv(
            {
                "world_id": world.id,
                "world_size": world_size,
                "rank_offset": 1,
                "packed": info.packed,
                "packed_buffer_size_bytes": info.packed_buffer_size_bytes,
                "timeout_s": info.timeouts.transfer_s,
            }
        )

    def sender(self, link: Any, settings: Any, parts: SenderParts) -> RoundSender:
        assert parts.packer is not None
        count = settings.packed_num_buffers
        return DevicePipeline(
            link,
            parts.packer,
            FakeSlots(),
            packed=settings.packed,
            num_buffers=count,
            timeout=settings.timeouts.transfer_s,
            hold_bytes=settings.packed_buffer_size_bytes * count,
        )

    def peer_fields(self, payload: dict[str, Any]) -> dict[str, Any]:
        return {"world_id": payload["world_id"], "world_size": payload["world_size"]}

    def join_peer(self, info: Any, fields: dict[str, Any], *, rank: int, timeout: float) -> Any:
        world = FakeWorld.worlds[fields["world_id"]]
        assert world.size == fields["world_size"]
        return world.member(rank)


register_backend(FakeGroupBackend(), replace=True)


class FakeWorkers:
    """The inference workers of a ``FakeServer``: members ``rank_offset..world_size-1``.

    ``received[w]`` maps each name to the sha256 of the bytes worker ``w`` received;
    ``corrupt`` names a tensor whose recorded digest is falsified on every worker (a load
    into the wrong place), which a verified round must catch.
    """

    def __init__(self, server: FakeServer) -> None:
        self.server = server
        self.members: list[FakeMember] = []
        self.received: list[dict[str, str]] = []
        self.metas: dict[int, list[ParamMeta]] = {}
        self.srcs: list[int] = []
        self.corrupt: str | None = None
        self.init: dict[str, Any] = {}
        server.hooks["init_weight_transfer_engine"] = self._init
        server.hooks["update_weights"] = self._update
        real = server.handler

        def handler(request: Any) -> Any:  # the checker answers what the workers hold
            import httpx

            if request.url.path.endswith("/weight_checker"):
                return httpx.Response(
                    200,
                    json={
                        "checksums": dict(self.received[0]) if self.received else {},
                        "replica_checksums": [dict(r) for r in self.received],
                    },
                )
            return real(request)

        server.handler = handler  # type: ignore[method-assign]

    def _init(self, body: Any) -> None:
        info = self.init = body["init_info"]
        world = FakeWorld.worlds[info["world_id"]]
        self.members = [world.member(r) for r in range(info["rank_offset"], info["world_size"])]
        self.received = [{} for _ in self.members]
        self.metas = {}
        self._all(lambda m, i: m.warmup(timeout=10))

    def _all(self, fn: Any) -> None:
        errors: list[BaseException] = []

        def run(m: FakeMember, i: int) -> None:
            try:
                fn(m, i)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=run, args=(m, i)) for i, m in enumerate(self.members)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if errors:
            raise errors[0]

    def _update(self, body: Any) -> None:
        info = body["update_info"]
        src = info.get("src", 0)
        self.srcs.append(src)
        if info["names"]:
            self.metas[src] = [
                ParamMeta(n, d, tuple(s))
                for n, d, s in zip(info["names"], info["dtype_names"], info["shapes"], strict=True)
            ]
        metas = self.metas[src]
        chunks = plan(
            metas,
            packed=self.init["packed"],
            buffer_size_bytes=self.init["packed_buffer_size_bytes"],
        )

        def receive(member: FakeMember, i: int) -> None:
            for chunk in chunks:
                buf = np.empty(chunk.nbytes, np.uint8)
                member.broadcast(buf, root=src, timeout=self.init["timeout_s"])
                for j, off in enumerate(chunk.offsets):
                    meta = metas[chunk.start + j]
                    data = buf[off : off + meta.nbytes].tobytes()
                    if meta.name == self.corrupt:
                        data = b"wrong" + data
                    self.received[i][meta.name] = hashlib.sha256(data).hexdigest()

        self._all(receive)
