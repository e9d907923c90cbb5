"""Rendezvous: from a validated init info to a connected, warmed-up ``ReceiveLink``.

``connect`` dispatches on the init info's ``backend`` through the registry
(``weightwire.backends``): each backend's connect function (``backends.worker_base.Connect``)
lives in its package and is imported on the first init, so a TCP-only CPU worker
never imports the NCCL or IPC code (nor cupy), and a process that only registers the
plugin imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from weightwire import backends
from weightwire.backends.worker_base import takes_landing

if TYPE_CHECKING:
    import torch

    from weightwire.backends.worker_base import LandingRecord, ReceiveLink


def connect(
    info: Any,
    *,
    rank: int,
    device: torch.device,
    landing: Callable[[], LandingRecord] | None = None,
    **hello: Any,
) -> ReceiveLink:
    """Join the trainer's group as ``rank`` on ``device`` with ``info`` (a shared init info).
    ``landing`` reaches a backend whose connect asks for it (``worker_base.Connect``);
    ``hello``: what the worker tells the trainer at the join, passed only where the init
    info asked for it (``sliced``: ``hello=`` the wants' JSON)."""
    spec = backends.spec_of_init_info(type(info))
    if spec.connect is None:
        raise ValueError(
            f"backend {spec.name!r} is received by vLLM's own engine only; "
            f"a weightwire worker speaks {', '.join(backends.PLUGIN_BACKENDS)}"
        )
    backend_connect = backends.load(spec.connect)
    extra = {"landing": landing} if landing is not None and takes_landing(backend_connect) else {}
    link: ReceiveLink = backend_connect(info, rank=rank, device=device, **extra, **hello)
    return link
