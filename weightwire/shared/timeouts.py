"""Every blocking wait's default timeout, in one place.

NCCL collectives and vLLM's routes have no timeout of their own; each wait in
weightwire takes its bound from here (or from a caller's override), so no step can
block forever. Override per engine with ``Timeouts(...)`` or process-wide with
``WEIGHTWIRE_TIMEOUT_<FIELD>`` environment variables (seconds).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, replace

from weightwire.shared.checks import check_seconds
from weightwire.shared.errors import ConfigError


@dataclass(frozen=True)
class Timeouts:
    http_s: float = 300.0
    """One control-plane HTTP call (init and update block while workers receive)."""
    connect_s: float = 60.0
    """Rendezvous: NCCL ``ncclCommInitRank`` / TCP accept of every receiver."""
    warmup_s: float = 60.0
    """The warm-up all-reduce / TCP hello exchange after rendezvous."""
    transfer_s: float = 300.0
    """One broadcast (a chunk or a tensor) from start to landed on every receiver."""
    round_s: float = 3600.0
    """A wait for an overlapped round (``send_weights(wait=False)``): its handle's
    ``result()``, a ``send_weights`` waiting for a free slot, ``shutdown``'s drain."""

    def __post_init__(self) -> None:
        # A bound that is no finite positive number is refused where it is written, not
        # after the init POST left: a ``-1`` abandoned the init at once and left the server
        # busy with the half-made session until its own connect timeout.
        for f in fields(self):
            check_seconds(f"Timeouts.{f.name}", getattr(self, f.name))

    @classmethod
    def from_env(cls) -> Timeouts:
        """Defaults overridden by ``WEIGHTWIRE_TIMEOUT_<FIELD>``.

        A bad value raises naming the variable.
        """
        values: dict[str, float] = {}
        for f in fields(cls):
            var = f"WEIGHTWIRE_TIMEOUT_{f.name.upper()}"
            raw = os.environ.get(var)
            if raw is None:
                continue
            try:
                value = float(raw)
            except ValueError:
                raise ConfigError(f"{var} must be a number of seconds, got {raw[:60]!r}") from None
            values[f.name] = check_seconds(var, value)
        return replace(cls(), **values)


DEFAULT_TIMEOUTS = Timeouts()
