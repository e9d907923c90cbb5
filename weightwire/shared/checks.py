"""The value checks every boundary shares: one function, one message per kind of value.

A configuration value is checked where it enters (``TrainerInitInfo``, an init info,
an environment variable, a command-line flag) with these, so the same mistake reads
the same wherever it is made. Each raises ``ConfigError`` (a ``ValueError``) naming
``what`` and the value, bounded (``limits.bounded_repr``).
"""

from __future__ import annotations

import math
import os

from weightwire.shared.errors import ConfigError
from weightwire.shared.limits import LIMITS, bounded_repr


def check_int_in(what: str, value: object, low: int, high: int) -> int:
    """``value`` as an int (not a bool) in ``[low, high]``."""
    if type(value) is not int or not low <= value <= high:
        raise ConfigError(f"{what} must be an int in [{low}, {high}], got {bounded_repr(value)}")
    return value


def check_buffer_size(what: str, value: object) -> int:
    """A packed buffer's size in bytes: ``[1, LIMITS.max_buffer_size_bytes]``."""
    return check_int_in(what, value, 1, LIMITS.max_buffer_size_bytes)


def check_num_buffers(what: str, value: object) -> int:
    """How many packed buffers rotate: ``[1, LIMITS.max_num_buffers]``."""
    return check_int_in(what, value, 1, LIMITS.max_num_buffers)


def check_seconds(what: str, value: object, *, most: float = math.inf) -> float:
    """``value`` as a finite number of seconds > 0 (and <= ``most``): a timeout's bound.

    inf would mean "wait forever", the very thing a timeout exists to stop; nan fails
    every comparison. The chained comparison is exact for ints past float range
    (``10**400``), where ``math.isfinite`` would raise ``OverflowError``.
    """
    ok = (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and 0 < value < math.inf
        and value <= most
    )
    if not ok:
        bound = "" if most == math.inf else f" and <= {most:g}"
        raise ConfigError(
            f"{what} must be a finite number of seconds > 0{bound}, got {bounded_repr(value)}"
        )
    return value  # type: ignore[return-value]  # an int is a number of seconds too


def env_switch(name: str, default: bool, on: str, off: str) -> bool:
    """The ``0`` / ``1`` environment variable ``name`` (unset: ``default``); ``on`` and
    ``off`` say what each value does, for the message naming the fix."""
    value = os.environ.get(name, "1" if default else "0")
    if value not in ("0", "1"):
        raise ConfigError(
            f"{name} must be '0' or '1', got {bounded_repr(value)}: unset it or set "
            f"1 ({on}), or 0 ({off})"
        )
    return value == "1"
