"""What a worker process refuses or stops on its own: generations the API no longer waits
for, and rounds whose tensors are not finite (``--check-finite``)."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from weightwire.shared.errors import ReferenceServerError


class NonFiniteRound(ReferenceServerError, ValueError):
    """A round refused at finish (``--check-finite``): some received tensors hold NaN or inf."""


class LiveCalls:
    """Generations queued or running on the serve lane, by call id, and those the API
    stopped waiting for (its timeout, or its client left). Written by the stdin reader,
    read by the decode loop between steps."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[int] = set()
        self._cancelled: set[int] = set()

    def arrived(self, call_id: int) -> None:
        with self._lock:
            self._live.add(call_id)

    def cancel(self, call_id: object) -> None:
        """Mark a live call cancelled; an id that already ended (or never came) is not
        remembered."""
        with self._lock:
            if call_id in self._live:
                self._cancelled.add(call_id)

    def cancelled(self, call_id: int) -> bool:
        return call_id in self._cancelled

    def ended(self, call_id: int) -> None:
        with self._lock:
            self._live.discard(call_id)
            self._cancelled.discard(call_id)


def refuse_non_finite(pairs: Iterable[tuple[str, Any]], *, in_place: bool = False) -> None:
    """Raise ``NonFiniteRound`` naming (up to five of) the round's not yet committed tensors
    (``(name, torch.Tensor)``) that hold NaN or infinity. ``in_place``: the round was
    applied in place, so the parameters hold part of it already (its failure leaves the
    model incomplete, refused until a whole round commits)."""
    bad = [
        name
        for name, t in pairs
        if (t.is_floating_point() or t.is_complex()) and not bool(_finite(t).all())
    ]
    if bad:
        shown = ", ".join(repr(n) for n in bad[:5]) + (
            f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        )
        served = (
            "it was applied in place, so the model holds part of it: generation is refused "
            "until a whole round commits"
            if in_place
            else "the previous weights are served"
        )
        raise NonFiniteRound(
            f"the round's tensor(s) {shown} hold NaN or infinite values (--check-finite); "
            f"nothing was committed and {served}"
        )


def _finite(t: Any) -> Any:
    """``t.isfinite()``; a float8 tensor (torch has no ``isfinite`` for it: an FP8 checkpoint's
    weights, a delta round's values of them) read as float32, which keeps its NaN and inf."""
    if t.is_floating_point() and t.element_size() == 1:
        return t.float().isfinite()
    return t.isfinite()
