"""The vLLM general plugin: makes weightwire's backends (``weightwire_tcp``, ...) valid in vLLM.

Declared in pyproject as the ``vllm.general_plugins`` entry point ``weightwire``, so
vLLM runs ``register()`` in every process it starts (API server, engine core, each
worker); ``--weight-transfer-config '{"backend": "weightwire_tcp"}'`` then resolves in
all of them. It registers every registry entry that has a ``vllm_engine``
(``weightwire.backends.PLUGIN_BACKENDS``), so a backend added there is registered
here too. Registration is by module path: the engine module (and with it cupy or the
TCP transport) is imported only when a worker actually creates the engine.

Safe everywhere: without vLLM ``register()`` logs at debug level and returns, and
calling it again (vLLM may load plugins more than once per process) is a no-op.
"""

from __future__ import annotations

import logging

from weightwire import backends
from weightwire.shared.timeouts import Timeouts
from weightwire.vllm_guard.worker import install_worker_method

log = logging.getLogger(__name__)


def engines() -> dict[str, tuple[str, str]]:
    """``{backend name: (engine module, engine class name)}``: what ``register`` registers."""
    out = {}
    for name in backends.PLUGIN_BACKENDS:
        module, _, class_name = str(backends.SPECS[name].vllm_engine).partition(":")
        out[name] = (module, class_name)
    return out


def register() -> None:
    """Register the plugin backends with vLLM's ``WeightTransferEngineFactory`` (idempotent).

    A bad ``WEIGHTWIRE_TIMEOUT_*`` raises ``ConfigError`` naming the variable here, so vLLM
    refuses to start instead of failing every later init with a 500."""
    Timeouts.from_env()
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError as exc:
        log.debug(
            "weightwire plugin: vLLM weight transfer is not importable (%s); nothing registered",
            exc,
        )
        return
    # The round guard asks the workers whether their weights are whole (weightwire.vllm_guard).
    install_worker_method()
    for name, (module, class_name) in engines().items():
        try:
            WeightTransferEngineFactory.register_engine(name, module, class_name)
        except ValueError:
            # vLLM 0.32 and 0.33 both refuse a duplicate name with ValueError; a
            # second plugin load in the same process lands here.
            log.debug("weightwire plugin: backend %r already registered", name)
        else:
            log.debug("weightwire plugin: registered backend %r -> %s.%s", name, module, class_name)
