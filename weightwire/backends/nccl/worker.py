"""The worker's end of ``weightwire_nccl``: join the trainer's NCCL group, receive.

``connect_nccl`` is the registry's ``connect`` for the backend (``weightwire.backends``);
``NCCLLink`` enqueues each chunk's broadcast on one of ``depth`` CUDA streams. The
address/port rendezvous (a TCPStore holding the unique id) is ``publish_unique_id`` /
``fetch_unique_id``. cupy is imported by ``comm`` when a communicator is first made.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from weightwire.backends.device import DeviceBytes, tensor_device_bytes
from weightwire.backends.nccl.comm import NCCLCommunicator
from weightwire.backends.nccl.info import NCCL_UNIQUE_ID_BYTES, WeightwireNCCLInitInfo
from weightwire.backends.nccl.slices import LENGTH, MAX_TABLE_BYTES, parse_table, send_hello
from weightwire.backends.receiving import ChunkedLink
from weightwire.backends.worker_base import ReceiveProgress, ReceiveTurn
from weightwire.shared.dtypes import wire_dtype
from weightwire.shared.errors import TransferError
from weightwire.shared.meta import ParamMeta
from weightwire.shared.slices import Box
from weightwire.shared.staging import round_bytes
from weightwire.shared.timeouts import Timeouts

log = logging.getLogger(__name__)

_CPU_STREAMS = 0x7100
"""Made-up stream pointers of a CPU link (a stand-in CuPy's streams are keyed by them)."""

UNIQUE_ID_KEY = "weightwire/nccl_unique_id/v1"
"""TCPStore key under which a weightwire trainer publishes the 128-byte NCCL unique id
(address/port rendezvous of ``weightwire_nccl``)."""


def connect_nccl(
    info: WeightwireNCCLInitInfo, *, rank: int, device: torch.device, hello: bytes = b""
) -> NCCLLink:
    """Join the trainer's NCCL group as ``rank`` on ``device`` and run the warm-up all-reduce.

    The unique id comes from the init info, or (address/port mode) from the
    trainer's TCPStore under ``UNIQUE_ID_KEY``; see ``publish_unique_id``. When the init
    info asks for wants (``sliced``), ``hello`` (their JSON; empty: every tensor whole) goes
    to rank 0 right after the warm-up (``backends.nccl.slices``).
    """
    if device.type != "cuda":
        raise ValueError(f"weightwire_nccl needs a CUDA worker device, got {device}")
    return join_link(info, rank=rank, device=device, hello=hello)


def join_link(
    info: WeightwireNCCLInitInfo, *, rank: int, device: torch.device, hello: bytes = b""
) -> NCCLLink:
    """``connect_nccl`` past its device check (a CPU device: only with a stand-in CuPy,
    the tests' in-process NCCL)."""
    # Rendezvous and warm-up are bounded by this worker's own Timeouts; the trainer's
    # timeout_s (init info) bounds each transfer, where both sides must agree.
    local = Timeouts.from_env()
    uid = info.unique_id_bytes
    if uid is None:
        assert (
            info.master_address is not None and info.master_port is not None
        )  # __post_init__ ensures
        uid = fetch_unique_id(info.master_address, info.master_port, timeout_s=local.connect_s)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
    else:
        index = 0
    comm = NCCLCommunicator.join(
        unique_id=uid, rank=rank, world_size=info.world_size, device=index, timeout=local.connect_s
    )
    try:
        comm.warmup(timeout=local.warmup_s)
    except BaseException:
        comm.abort()
        raise
    # Every trainer rank below the offset may be a turn's src (one group, several roots).
    link = NCCLLink(
        comm,
        device=torch.device("cuda", index) if device.type == "cuda" else device,
        timeout_s=info.timeout_s,
        depth=info.packed_num_buffers,
        sources=info.rank_offset,
    )
    if info.sliced:
        try:
            link.send_hello(hello)
        except BaseException:
            comm.abort()
            raise
    return link


def publish_unique_id(host: str, port: int, unique_id: bytes, *, timeout_s: float) -> Any:
    """Trainer side of the address/port mode: host a TCPStore holding the unique id.

    Keep the returned store alive until every worker joined (the init request
    returned). The store is unauthenticated, like vLLM's own: anyone who reaches the
    port can read the id, so bind it to a trusted network.
    """
    if len(unique_id) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"unique id must be {NCCL_UNIQUE_ID_BYTES} bytes, got {len(unique_id)}")
    store = torch.distributed.TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    store.set(UNIQUE_ID_KEY, unique_id)  # type: ignore[arg-type]  # TCPStore takes bytes too; torch's stub says str
    return store


def fetch_unique_id(host: str, port: int, *, timeout_s: float) -> bytes:
    """Worker side: read the unique id from the trainer's TCPStore (waits up to ``timeout_s``)."""
    try:
        store = torch.distributed.TCPStore(
            host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
        )
        uid = bytes(store.get(UNIQUE_ID_KEY))
    except Exception as exc:  # torch raises DistStoreError / RuntimeError variants
        raise TimeoutError(
            "weightwire_nccl: could not read the NCCL unique id "
            f"from the TCPStore at {host}:{port} "
            f"within {timeout_s:.0f}s ({type(exc).__name__}); is the trainer publishing it?"
        ) from None
    if len(uid) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(
            f"TCPStore at {host}:{port} holds a {len(uid)}-byte unique id, "
            f"expected {NCCL_UNIQUE_ID_BYTES}"
        )
    return uid


@dataclass(frozen=True)
class _Posted:
    """A chunk whose broadcast is enqueued on ``stream``."""

    buffer: torch.Tensor
    stream: int
    """The stream's pointer."""


class NCCLLink(ChunkedLink):
    """NCCL data plane: chunk ``i`` is enqueued on stream ``i % depth``.

    ``wait`` blocks through the communicator's watchdog (``synchronize`` with a
    timeout), since an NCCL wait has no timeout of its own. Unpacked rounds use the
    tensor's own NCCL dtype, as a stock vLLM trainer sends them. A turn's ``src`` is
    its broadcast root.
    """

    def __init__(
        self,
        communicator: Any,
        *,
        device: torch.device,
        timeout_s: float,
        depth: int,
        sources: int = 1,
    ) -> None:
        super().__init__(device=device, timeout_s=timeout_s, depth=depth, sources=sources)
        self.communicator = communicator
        self._cuda = device.type == "cuda"
        self._streams = (
            [torch.cuda.Stream(device=device) for _ in range(self.depth)] if self._cuda else []
        )
        self._pending: dict[int, _Posted] = {}

    def _stream_ptr(self, i: int) -> int:
        """Stream ``i``'s pointer; on a CPU device (a stand-in CuPy only) a made-up one."""
        return self._streams[i].cuda_stream if self._cuda else _CPU_STREAMS + i

    def _buffer(
        self, nbytes: int, stream: int, fill: bytes | None = None
    ) -> tuple[torch.Tensor, DeviceBytes]:
        """A fresh device buffer (holding ``fill``) that NCCL may use on ``stream``."""
        buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if fill is not None:
            buf.copy_(torch.frombuffer(bytearray(fill), dtype=torch.uint8))
        if not self._cuda:
            return buf, DeviceBytes(buf.data_ptr(), nbytes, None, buf)
        torch_stream = next(s for s in self._streams if s.cuda_stream == stream)
        # The fresh block may have just been freed by work still queued on the current
        # stream (and ``fill`` is copied there); NCCL must not touch it before that ends.
        torch_stream.wait_stream(torch.cuda.current_stream(self.device))
        buf.record_stream(torch_stream)
        return buf, tensor_device_bytes(buf)

    def send_hello(self, hello: bytes) -> None:
        """This worker's wants to rank 0, enqueued on stream 0 and not waited on here (rank 0
        takes them after its warm-up, while this worker's init may still be running; the
        next synchronize of stream 0 releases the buffers)."""
        stream = self._stream_ptr(0)

        def device(data: bytes) -> DeviceBytes:
            return self._buffer(len(data), stream, fill=data)[1]

        send_hello(self.communicator, hello, device, stream)

    def _recv_now(self, nbytes: int) -> bytes:
        stream = self._stream_ptr(0)
        buf, view = self._buffer(nbytes, stream)
        self.communicator.recv(view, peer=0, stream=stream)
        self.communicator.synchronize(stream, timeout=self.timeout_s)
        return bytes(buf.cpu().numpy().tobytes())

    def receive_sliced(
        self, metas: Sequence[ParamMeta], progress: ReceiveProgress
    ) -> Iterator[tuple[int, Box, torch.Tensor]]:
        """This worker's table from rank 0, then its chunks, ``depth`` posted ahead of the
        one whose pieces are yielded (views of the chunk, on this worker's device). The
        caller checks the union (``Cover``)."""
        where = f"NCCL sliced round on {self.communicator!r}"
        (length,) = LENGTH.unpack(self._recv_now(LENGTH.size))
        if length > MAX_TABLE_BYTES:
            raise TransferError(
                f"{where}: rank 0 announced a {length}-byte table, over the "
                f"{MAX_TABLE_BYTES}-byte bound"
            )
        pieces, spans = parse_table(self._recv_now(length), metas, where)
        total, bound = sum(p.nbytes for p in pieces), round_bytes(metas)
        if total > bound:
            raise TransferError(
                f"{where}: the table's pieces hold {total} bytes, more than the update's {bound}"
            )
        posted: dict[int, tuple[torch.Tensor, int]] = {}

        def post(k: int) -> None:
            stream = self._stream_ptr(k % self.depth)
            buf, view = self._buffer(spans[k].nbytes, stream)
            self.communicator.recv(view, peer=0, stream=stream)
            posted[k] = (buf, stream)

        ahead = 0
        for k, span in enumerate(spans):
            progress.chunk = k
            while ahead < len(spans) and ahead < k + self.depth:
                post(ahead)
                ahead += 1
            buf, stream = posted.pop(k)
            self.communicator.synchronize(stream, timeout=self.timeout_s)
            for p in pieces[span.start : span.stop]:
                progress.nbytes += p.nbytes
                yield p.tensor, p.box, buf[p.offset : p.offset + p.nbytes]
            del buf

    def post(self, index: int, turn: ReceiveTurn) -> None:
        chunk = turn.chunks[index]
        stream = self._stream_ptr(index % self.depth)
        # Handed over as a raw pointer (``_buffer`` ordered it after the current stream):
        # going through DLPack costs ~0.2 ms per chunk on the round's critical path.
        buf, view = self._buffer(chunk.nbytes, stream)
        if turn.packed:
            self.communicator.broadcast(view, root=turn.src, timeout=self.timeout_s, stream=stream)
        else:
            meta = turn.metas[chunk.start]
            self.communicator.broadcast_typed(
                view,
                nccl_dtype=wire_dtype(meta.dtype).nccl,
                count=meta.numel,
                root=turn.src,
                timeout=self.timeout_s,
                stream=stream,
            )
        self._pending[index] = _Posted(buf, stream)

    def wait(self, index: int) -> torch.Tensor:
        posted = self._pending.pop(index)
        self.communicator.synchronize(posted.stream, timeout=self.timeout_s)
        return posted.buffer

    def abort(self) -> None:
        self._pending.clear()
        self.communicator.abort()

    def close(self) -> None:
        self._pending.clear()
        self.communicator.close()
