"""``WeightwireIPCEngine``: the ``weightwire_ipc`` receiver outside vLLM (reference server).

Same session rules and failure handling as the other engines (``_ReceiverCore``); the
data plane is ``backends.ipc.worker`` (found through the registry, as for every
engine): pull mode (packed, the default) lends the trainer exported receive buffers it
writes into, no copy here; push mode opens the trainer's slots once per session and
copies each piece out.
"""

from __future__ import annotations

from weightwire.backends import IPC
from weightwire.shared.ipc_info import IPCInitInfo
from weightwire.torch_side.worker.engines import StandaloneEngine


class WeightwireIPCEngine(StandaloneEngine):
    """``weightwire_ipc`` receiver: a GPU worker on the trainer's host (same GPU or a peer GPU)."""

    backend = IPC
    init_info_cls = IPCInitInfo  # type: ignore[assignment]
