"""In-process ``weightwire_tcp`` peers for the backend tests: workers dial a rendezvous from
threads; a root and its receivers joined, warmed up when asked."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from weightwire.backends.tcp.comm import TCPCommunicator
from weightwire.backends.tcp.rendezvous import TCPRendezvous


def dial(
    rendezvous: TCPRendezvous,
    rank: int,
    *,
    secret: bytes | None = None,
    world_size: int | None = None,
    timeout: float = 10,
    **connect_kw: Any,
) -> TCPCommunicator:
    """Worker ``rank`` joins ``rendezvous`` at its endpoint, with its secret unless told."""
    return TCPCommunicator.connect(
        host=rendezvous.host,
        port=rendezvous.port,
        secret=secret or rendezvous.secret,
        rank=rank,
        world_size=world_size or rendezvous.world_size,
        timeout=timeout,
        **connect_kw,
    )


def accepted(
    rendezvous: TCPRendezvous, **connect_kw: Any
) -> tuple[TCPCommunicator, list[TCPCommunicator]]:
    """The root and every worker rank of ``rendezvous``, each dialing from its thread."""
    ranks = range(1, rendezvous.world_size)
    with ThreadPoolExecutor(len(ranks)) as pool:
        futures = [pool.submit(dial, rendezvous, r, **connect_kw) for r in ranks]
        root = rendezvous.accept(timeout=10)
        return root, [f.result(timeout=10) for f in futures]


def joined(
    world_size: int = 2, *, hellos: list[bytes] | None = None, **connect_kw: Any
) -> tuple[TCPCommunicator, list[TCPCommunicator]]:
    """A root and ``world_size - 1`` receivers, warmed up (receiver ``i``'s ready carries
    ``hellos[i]``)."""
    root, receivers = accepted(TCPRendezvous(world_size=world_size), **connect_kw)
    said = hellos if hellos is not None else [b""] * len(receivers)
    with ThreadPoolExecutor(world_size) as pool:
        warm = [pool.submit(root.warmup, timeout=10)]
        warm += [
            pool.submit(c.warmup, timeout=10, hello=h) for c, h in zip(receivers, said, strict=True)
        ]
        for f in warm:
            f.result(timeout=10)
    return root, receivers
