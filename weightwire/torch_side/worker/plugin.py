"""The vLLM general plugin: makes ``weightwire_tcp`` / ``weightwire_nccl`` valid backends.

Declared in pyproject as the ``vllm.general_plugins`` entry point ``weightwire``, so
vLLM runs ``register()`` in every process it starts (API server, engine core, each
worker); ``--weight-transfer-config '{"backend": "weightwire_tcp"}'`` then resolves in
all of them. Registration is by module path: the engine module (and with it cupy
or the TCP transport) is imported only when a worker actually creates the engine.

Safe everywhere: without vLLM ``register()`` logs at debug level and returns, and
calling it again (vLLM may load plugins more than once per process) is a no-op.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

ENGINE_MODULE = "weightwire.torch_side.worker.vllm_engines"
BACKENDS: dict[str, str] = {
    "weightwire_tcp": "VllmWeightwireTCPEngine",
    "weightwire_nccl": "VllmWeightwireNCCLEngine",
    "weightwire_ipc": "VllmWeightwireIPCEngine",
}


def register() -> None:
    """Register both backends with vLLM's ``WeightTransferEngineFactory`` (idempotent)."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory  # noqa: PLC0415
    except ImportError as exc:
        log.debug("weightwire plugin: vLLM weight transfer is not importable (%s); nothing registered", exc)
        return
    for name, class_name in BACKENDS.items():
        try:
            WeightTransferEngineFactory.register_engine(name, ENGINE_MODULE, class_name)
        except ValueError:
            # vLLM 0.32 and 0.33 both refuse a duplicate name with ValueError; a
            # second plugin load in the same process lands here.
            log.debug("weightwire plugin: backend %r already registered", name)
        else:
            log.debug("weightwire plugin: registered backend %r -> %s.%s", name, ENGINE_MODULE, class_name)
