"""``WeightwireIPCEngine``: the ``weightwire_ipc`` receiver outside vLLM (reference server).

Same session rules and failure handling as the other engines (``_ReceiverCore``); the
data plane is ``backends.ipc.worker``: the trainer's slots opened once per session, one
copy-out per piece.
"""

from __future__ import annotations

from weightwire.backends.ipc.worker import connect_ipc
from weightwire.shared.ipc_info import IPCInitInfo
from weightwire.torch_side.worker.engines import _StandaloneEngine


class WeightwireIPCEngine(_StandaloneEngine):
    """``weightwire_ipc`` receiver: a GPU worker on the trainer's host (same GPU or a peer GPU)."""

    backend = "weightwire_ipc"
    init_info_cls = IPCInitInfo  # type: ignore[assignment]
    _connect = staticmethod(connect_ipc)
