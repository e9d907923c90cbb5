"""What a worker operation's failure is: the reference server's own refusals, and the
kind (``replica.KIND_STATUS``) that decides the HTTP status the API answers with."""

from __future__ import annotations

from weightwire.shared.errors import (
    DeltaBaseMismatch,
    ReferenceServerError,
    TransferError,
    TransferTimeout,
)
from weightwire.tools.server.sleep import SleepCancelled, WeightsUnavailable


class GenerationAborted(ReferenceServerError):
    """A queued generation dropped by ``/pause?mode=abort``."""


class CommitAborted(ReferenceServerError):
    """A finish whose round was aborted (``abort`` op) before it could commit."""


class ModelIncomplete(ReferenceServerError):
    """A generation refused: the model holds part of a round applied in place."""


def classify(exc: BaseException) -> str:
    """Failure kind (see ``replica.KIND_STATUS``) of an exception raised by an operation."""
    from weightwire.tools.server.generate import NonFiniteOutput
    from weightwire.torch_side.worker.core import WeightReceiveError

    if isinstance(exc, GenerationAborted):
        return "aborted"
    if isinstance(exc, DeltaBaseMismatch):
        return "delta_base"
    if isinstance(exc, NonFiniteOutput):
        return "model"
    if isinstance(exc, WeightsUnavailable):
        return "unavailable"
    if isinstance(exc, SleepCancelled):
        return "timeout"  # only ever after the API's own wait ran out
    if isinstance(exc, ModelIncomplete):
        return "incomplete"
    if isinstance(exc, CommitAborted):
        return "transfer"
    if isinstance(exc, WeightReceiveError) and exc.__cause__ is not None:
        return classify(exc.__cause__)
    if isinstance(exc, (TransferTimeout, TimeoutError)):
        return "timeout"
    if isinstance(exc, (TransferError, ConnectionError)):
        return "transfer"
    if isinstance(exc, (ValueError, TypeError)):
        return "invalid"
    if isinstance(exc, RuntimeError) and not isinstance(exc, WeightReceiveError):
        return "conflict"  # the engine's session rules
    return "internal"
