"""Whether a round is staged or applied in place: the one rule trainer and worker share.

A worker holds a staged round's bytes in fresh memory until finish (all-or-nothing, but
a second copy of what the round carries); a round over the stage budget is applied in
place as its bytes land, so the worker's extra memory stays at its receive buffers plus
the budget whatever the model's size. The trainer must know which before the first
byte: an in-place round needs generation refused until it commits (the trainer pauses
the servers), so both sides call ``round_streams`` on the same byte count.
"""

from __future__ import annotations

from collections.abc import Iterable

from weightwire.shared.errors import ConfigError
from weightwire.shared.limits import LIMITS, bounded_repr
from weightwire.shared.meta import ParamMeta


def round_bytes(metas: Iterable[ParamMeta]) -> int:
    """The tensor bytes a round carries (padding and framing excluded)."""
    return sum(m.nbytes for m in metas)


def round_streams(nbytes: int, budget_bytes: int) -> bool:
    """True when a round of ``nbytes`` is applied in place (over the stage budget);
    ``budget_bytes == 0``: every round with a byte streams."""
    return nbytes > budget_bytes


def check_stage_budget(ctx: str, value: object) -> int:
    """``value`` as a stage budget (an int in ``[0, max_round_bytes]``), else ``ConfigError``."""
    if type(value) is not int or not 0 <= value <= LIMITS.max_round_bytes:
        raise ConfigError(
            f"{ctx} must be an int in [0, {LIMITS.max_round_bytes}] bytes (0: always apply in "
            f"place), got {bounded_repr(value)}"
        )
    return value
