"""Framework-neutral trainer round driver shared by the JAX and torch engines.

``TrainerInitInfo`` configures, ``TrainerEngine`` drives rounds, ``RoundMetrics``
reports them; ``backends`` is the trainer side's ``Backend`` contract (each built-in
backend lives in ``weightwire.backends``, whose ``BACKEND_NAMES`` is ``BACKENDS``) and
``pipelines`` the host / device data paths. Framework engines: ``weightwire.jax_side.engine`` and
``weightwire.torch_side.sender.engine``.
"""

from weightwire.backends import BACKEND_NAMES as BACKENDS
from weightwire.backends.nccl.stock import StockRefusal
from weightwire.trainer.config import TrainerInitInfo
from weightwire.trainer.engine import EngineBroken, TrainerEngine
from weightwire.trainer.freshness import StaleCacheError
from weightwire.trainer.metrics import RoundMetrics
from weightwire.trainer.verify import VerifyError, VerifyReport

__all__ = ["BACKENDS", "EngineBroken", "RoundMetrics", "StaleCacheError", "StockRefusal", "TrainerEngine",
           "TrainerInitInfo", "VerifyError", "VerifyReport"]
