"""The receiving side: worker engines, receive links, ``HFModelHost`` and the vLLM plugin.

Where a byte lands: ``connect`` (rendezvous, through the backend registry: each
backend's ``ReceiveLink``, ``weightwire.backends.worker_base``, is in
``weightwire.backends.<name>.worker``) -> ``receive`` (unpack) -> ``core`` (session
rules, failure handling, ``load_weights``) -> the model
(``hf_host.HFModelHost`` in the reference server, vLLM's model inside vLLM).

Import-light: nothing below is imported until used, and ``vllm_engines`` (the only
module importing vLLM) is imported by vLLM's factory alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weightwire._lazy import attach

if TYPE_CHECKING:  # the export list (``weightwire._lazy``): each name is imported on first use
    from weightwire.torch_side.worker.core import WeightReceiveError as WeightReceiveError
    from weightwire.torch_side.worker.engines import EngineFacade as EngineFacade
    from weightwire.torch_side.worker.engines import WeightwireIPCEngine as WeightwireIPCEngine
    from weightwire.torch_side.worker.engines import WeightwireNCCLEngine as WeightwireNCCLEngine
    from weightwire.torch_side.worker.engines import WeightwireTCPEngine as WeightwireTCPEngine
    from weightwire.torch_side.worker.hf_host import HFModelHost as HFModelHost
    from weightwire.torch_side.worker.load import ReceiveStats as ReceiveStats
    from weightwire.torch_side.worker.plugin import register as register

__getattr__, __dir__ = attach(__name__, globals())
