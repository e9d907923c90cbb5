"""Rendezvous: from a validated init info to a connected, warmed-up ``ReceiveLink``.

The transports are imported here, lazily, so that a TCP-only CPU worker never
imports cupy and a process that only registers the plugin imports neither.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Any

import torch

from weightwire.shared.info import NCCL_UNIQUE_ID_BYTES, TCPInitInfo, WeightwireNCCLInitInfo
from weightwire.shared.timeouts import Timeouts
from weightwire.torch_side.worker.receive import NCCLLink, ReceiveLink, TCPLink

log = logging.getLogger("weightwire.worker")

UNIQUE_ID_KEY = "weightwire/nccl_unique_id/v1"
"""TCPStore key under which a weightwire trainer publishes the 128-byte NCCL unique id
(address/port rendezvous of ``weightwire_nccl``)."""


def connect_tcp(info: TCPInitInfo, *, rank: int, device: torch.device) -> ReceiveLink:
    """Dial the trainer at ``info.host:info.port`` as ``rank``, prove the secret, warm up.

    Rendezvous and warm-up are bounded by this worker's own ``Timeouts``; the init
    info's ``timeout_s`` bounds each transfer. A handshake the sender dropped before
    its verdict (it sheds idle connections when flooded) is retried until
    ``connect_s`` runs out; a refusal (wrong secret, rank, size) is not.
    """
    from weightwire.backends.tcp.comm import TCPCommunicator  # noqa: PLC0415  (lazy transport)
    from weightwire.shared.communicator import PeerLost  # noqa: PLC0415

    local = Timeouts.from_env()
    deadline = time.monotonic() + local.connect_s
    # Each broadcaster is the root of its own star: with one it is the whole group; with
    # several, the worker's star rank skips the other trainer ranks (not rank_offset: a
    # later data-parallel server's workers start past the earlier servers' ones).
    star_rank = rank - info.broadcasters + 1
    star_world = info.world_size - info.broadcasters + 1
    links: list[ReceiveLink] = []
    try:
        for src, (host, port, secret) in enumerate(info.endpoints):
            while True:
                try:
                    comm = TCPCommunicator.connect(
                        host=host, port=port, secret=secret, rank=star_rank,
                        world_size=star_world, timeout=max(0.001, deadline - time.monotonic()),
                    )
                    break
                except PeerLost as exc:
                    if time.monotonic() >= deadline:
                        raise
                    log.info("rank %d: TCP sender src %d dropped the handshake (%s); retrying", rank, src, exc)
                    time.sleep(0.05)  # a sender that drops at once (closing) must not be spun on
            try:
                comm.warmup(timeout=local.warmup_s)
            except BaseException:
                comm.abort()
                raise
            links.append(TCPLink(comm, device=device, timeout_s=info.timeout_s, depth=info.packed_num_buffers))
    except BaseException:
        for link in links:
            link.abort()
        raise
    if len(links) == 1:
        return links[0]
    from weightwire.torch_side.worker.sources import MultiSourceLink  # noqa: PLC0415

    return MultiSourceLink(links)


def connect_nccl(info: WeightwireNCCLInitInfo, *, rank: int, device: torch.device) -> ReceiveLink:
    """Join the trainer's NCCL group as ``rank`` on ``device`` and run the warm-up all-reduce.

    The unique id comes from the init info, or (address/port mode) from the
    trainer's TCPStore under ``UNIQUE_ID_KEY``; see ``publish_unique_id``.
    """
    from weightwire.backends.nccl.comm import NCCLCommunicator  # noqa: PLC0415  (cupy only on GPU hosts)

    if device.type != "cuda":
        raise ValueError(f"weightwire_nccl needs a CUDA worker device, got {device}")
    # Rendezvous and warm-up are bounded by this worker's own Timeouts; the trainer's
    # timeout_s (init info) bounds each transfer, where both sides must agree.
    local = Timeouts.from_env()
    uid = info.unique_id_bytes
    if uid is None:
        assert info.master_address is not None and info.master_port is not None  # __post_init__ ensures
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
    link = NCCLLink(comm, device=torch.device("cuda", index), timeout_s=info.timeout_s, depth=info.packed_num_buffers)
    link.senders = info.rank_offset  # every trainer rank below the offset may be a turn's src
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
        host, port, is_master=True, wait_for_workers=False,
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
            f"weightwire_nccl: could not read the NCCL unique id from the TCPStore at {host}:{port} "
            f"within {timeout_s:.0f}s ({type(exc).__name__}); is the trainer publishing it?"
        ) from None
    if len(uid) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"TCPStore at {host}:{port} holds a {len(uid)}-byte unique id, expected {NCCL_UNIQUE_ID_BYTES}")
    return uid
