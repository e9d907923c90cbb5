"""Framework-neutral trainer round driver shared by the JAX and torch engines.

``TrainerInitInfo`` configures, ``TrainerEngine`` drives rounds, ``RoundMetrics``
reports them; ``backends`` is the trainer's view of the backend registry (each backend's
trainer side implements ``weightwire.backends.base.Backend``; ``weightwire.backends.BACKEND_NAMES``
is ``BACKENDS``). Framework engines: ``weightwire.jax_side.engine`` and
``weightwire.torch_side.sender.engine``.
"""

from weightwire.backends import BACKEND_NAMES as BACKENDS
from weightwire.backends.base import StockRefusal
from weightwire.trainer.config import TrainerInitInfo
from weightwire.trainer.engine import EngineBroken, TrainerEngine
from weightwire.trainer.freshness import StaleCacheError
from weightwire.trainer.metrics import RoundMetrics
from weightwire.trainer.overlap import RoundHandle, RoundSkipped, RoundWaitTimeout
from weightwire.trainer.verify import VerifyError, VerifyReport

__all__ = [
    "BACKENDS",
    "EngineBroken",
    "RoundHandle",
    "RoundMetrics",
    "RoundSkipped",
    "RoundWaitTimeout",
    "StaleCacheError",
    "StockRefusal",
    "TrainerEngine",
    "TrainerInitInfo",
    "VerifyError",
    "VerifyReport",
]
