"""Rendezvous: from a validated init info to a connected, warmed-up ``ReceiveLink``.

``connect`` dispatches on the init info's ``backend`` through the registry
(``weightwire.backends``): each backend's connect function lives in its package
(``weightwire.backends.<name>.worker``) and is imported on the first init, so a
TCP-only CPU worker never imports the NCCL or IPC code (nor cupy), and a process
that only registers the plugin imports none of them.

``publish_unique_id`` / ``fetch_unique_id`` (the ``weightwire_nccl`` address/port
rendezvous, ``weightwire.backends.nccl.worker``) are also reachable here, imported on
first use: this is the path ``weightwire.torch_side.worker`` exports them from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from weightwire import backends

if TYPE_CHECKING:
    import torch

    from weightwire.torch_side.worker.receive import ReceiveLink

_NCCL_STORE = ("publish_unique_id", "fetch_unique_id", "UNIQUE_ID_KEY")


def connect(info: Any, *, rank: int, device: torch.device) -> ReceiveLink:
    """Join the trainer's group as ``rank`` on ``device`` with ``info`` (a shared init info)."""
    spec = backends.spec_of_init_info(type(info))
    if spec.connect is None:
        raise ValueError(f"backend {spec.name!r} is received by vLLM's own engine only; "
                         f"a weightwire worker speaks {', '.join(backends.PLUGIN_BACKENDS)}")
    link: ReceiveLink = backends.load(spec.connect)(info, rank=rank, device=device)
    return link


def __getattr__(name: str) -> Any:
    if name in _NCCL_STORE:
        return backends.load(f"weightwire.backends.nccl.worker:{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
