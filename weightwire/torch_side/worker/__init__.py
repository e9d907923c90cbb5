"""The receiving side: worker engines, receive links, ``HFModelHost`` and the vLLM plugin.

Where a byte lands: ``connect`` (rendezvous, through the backend registry: each
backend's link is ``weightwire.backends.<name>.worker``) -> ``receive`` (unpack) ->
``core`` (session rules, failure handling, ``load_weights``) -> the model
(``hf_host.HFModelHost`` in the reference server, vLLM's model inside vLLM).

Import-light: nothing below is imported until used, and ``vllm_engines`` (the only
module importing vLLM) is imported by vLLM's factory alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weightwire._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "WeightwireTCPEngine": "weightwire.torch_side.worker.engines",
    "WeightwireNCCLEngine": "weightwire.torch_side.worker.engines",
    "WeightwireIPCEngine": "weightwire.torch_side.worker.ipc_engine",
    "EngineFacade": "weightwire.torch_side.worker.engines",
    "WeightReceiveError": "weightwire.torch_side.worker.core",
    "ReceiveStats": "weightwire.torch_side.worker.core",
    "HFModelHost": "weightwire.torch_side.worker.hf_host",
    "publish_unique_id": "weightwire.backends.nccl.worker",
    "fetch_unique_id": "weightwire.backends.nccl.worker",
    "register": "weightwire.torch_side.worker.plugin",
}

__all__ = [
    "EngineFacade",
    "HFModelHost",
    "ReceiveStats",
    "WeightReceiveError",
    "WeightwireIPCEngine",
    "WeightwireNCCLEngine",
    "WeightwireTCPEngine",
    "fetch_unique_id",
    "publish_unique_id",
    "register",
]

if TYPE_CHECKING:
    from weightwire.backends.nccl.worker import fetch_unique_id, publish_unique_id
    from weightwire.torch_side.worker.core import ReceiveStats, WeightReceiveError
    from weightwire.torch_side.worker.engines import EngineFacade, WeightwireNCCLEngine, WeightwireTCPEngine
    from weightwire.torch_side.worker.hf_host import HFModelHost
    from weightwire.torch_side.worker.ipc_engine import WeightwireIPCEngine
    from weightwire.torch_side.worker.plugin import register


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
