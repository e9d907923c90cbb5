"""The worker's end of ``weightwire_nccl``: join the trainer's NCCL group, receive.

``connect_nccl`` is the registry's ``connect`` for the backend (``weightwire.backends``);
``NCCLLink`` enqueues each chunk's broadcast on one of ``depth`` CUDA streams. The
address/port rendezvous (a TCPStore holding the unique id) is ``publish_unique_id`` /
``fetch_unique_id``. cupy is imported by ``comm`` when a communicator is first made.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any

import torch

from weightwire.backends.device import tensor_device_bytes
from weightwire.backends.nccl.comm import NCCLCommunicator
from weightwire.backends.nccl.info import NCCL_UNIQUE_ID_BYTES, WeightwireNCCLInitInfo
from weightwire.backends.receiving import ChunkedLink
from weightwire.backends.worker_base import ReceiveTurn
from weightwire.shared.dtypes import wire_dtype
from weightwire.shared.timeouts import Timeouts

log = logging.getLogger(__name__)

UNIQUE_ID_KEY = "weightwire/nccl_unique_id/v1"
"""TCPStore key under which a weightwire trainer publishes the 128-byte NCCL unique id
(address/port rendezvous of ``weightwire_nccl``)."""


def connect_nccl(info: WeightwireNCCLInitInfo, *, rank: int, device: torch.device) -> NCCLLink:
    """Join the trainer's NCCL group as ``rank`` on ``device`` and run the warm-up all-reduce.

    The unique id comes from the init info, or (address/port mode) from the
    trainer's TCPStore under ``UNIQUE_ID_KEY``; see ``publish_unique_id``.
    """
    if device.type != "cuda":
        raise ValueError(f"weightwire_nccl needs a CUDA worker device, got {device}")
    # Rendezvous and warm-up are bounded by this worker's own Timeouts; the trainer's
    # timeout_s (init info) bounds each transfer, where both sides must agree.
    local = Timeouts.from_env()
    uid = info.unique_id_bytes
    if uid is None:
        assert (
            info.master_address is not None and info.master_port is not None
        )  # __post_init__ ensures
        uid = fetch_unique_id(info.master_address, info.master_port, timeout_s=local.connect_s)
    index = device.index if device.index is not None else torch.cuda.current_device()
    comm = NCCLCommunicator.join(
        unique_id=uid, rank=rank, world_size=info.world_size, device=index, timeout=local.connect_s
    )
    try:
        comm.warmup(timeout=local.warmup_s)
    except BaseException:
        comm.abort()
        raise
    # Every trainer rank below the offset may be a turn's src (one group, several roots).
    return NCCLLink(
        comm,
        device=torch.device("cuda", index),
        timeout_s=info.timeout_s,
        depth=info.packed_num_buffers,
        sources=info.rank_offset,
    )


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
    stream: torch.cuda.Stream


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
        self._streams = [torch.cuda.Stream(device=device) for _ in range(self.depth)]
        self._pending: dict[int, _Posted] = {}

    def post(self, index: int, turn: ReceiveTurn) -> None:
        chunk = turn.chunks[index]
        stream = self._streams[index % self.depth]
        buf = torch.empty(chunk.nbytes, dtype=torch.uint8, device=self.device)
        # The fresh block may have just been freed by work still queued on the
        # current stream; the receive must not overwrite it before that work ends.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # Handed over as a raw pointer: the wait above already orders it, and going
        # through DLPack costs ~0.2 ms per chunk on the round's critical path.
        view = tensor_device_bytes(buf)
        if turn.packed:
            self.communicator.broadcast(
                view, root=turn.src, timeout=self.timeout_s, stream=stream.cuda_stream
            )
        else:
            meta = turn.metas[chunk.start]
            self.communicator.broadcast_typed(
                view,
                nccl_dtype=wire_dtype(meta.dtype).nccl,
                count=meta.numel,
                root=turn.src,
                timeout=self.timeout_s,
                stream=stream.cuda_stream,
            )
        buf.record_stream(stream)
        self._pending[index] = _Posted(buf, stream)

    def wait(self, index: int) -> torch.Tensor:
        posted = self._pending.pop(index)
        self.communicator.synchronize(posted.stream.cuda_stream, timeout=self.timeout_s)
        return posted.buffer

    def abort(self) -> None:
        self._pending.clear()
        self.communicator.abort()

    def close(self) -> None:
        self._pending.clear()
        self.communicator.close()
