"""Bounds every parser enforces before allocating anything from untrusted input.

A worker sizes receive buffers from the update info, so an unchecked shape is an
allocation of attacker-chosen size. These limits are far above any real model and
far below what would exhaust a host.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_tensors: int = 1_000_000
    max_rank: int = 16
    max_name_length: int = 1024
    max_tensor_bytes: int = 1 << 40  # 1 TiB: larger than any single weight today
    max_round_bytes: int = 1 << 44  # 16 TiB in one round
    max_buffer_size_bytes: int = 1 << 36  # 64 GiB packing buffer
    max_num_buffers: int = 16
    max_world_size: int = 65_536
    max_weight_version_chars: int = 1024
    """A round's ``weight_version``: the reference server refuses a longer one, so the trainer
    refuses it before the round's first call (a version refused by the update that carries
    the finish would fail a round already on the wire)."""


LIMITS = Limits()

DEFAULT_STAGE_BUDGET_BYTES = 1 << 30
"""A round of at most this many bytes is staged by the worker (received whole, then applied
in one call); a larger one is applied in place as its bytes land (see ``staging``)."""


def bounded_repr(value: object, limit: int = 60) -> str:
    """A short, always-safe description of an untrusted value for error messages.

    Plain ``repr`` is unsafe on parsed input: a deeply nested list raises
    ``RecursionError``, an int of more than 4300 digits raises an unrelated
    ``ValueError``, and a megabyte string would be copied into the message.
    (``reprlib`` is not used because it still calls ``repr`` on ints.)
    """
    if value is None or isinstance(value, (bool, float)):
        return repr(value)
    if isinstance(value, int):
        bits = value.bit_length()
        return repr(value) if bits <= 128 else f"<int of {bits} bits>"
    if isinstance(value, (str, bytes, bytearray)):
        head = repr(value[:limit])
        return head if len(value) <= limit else f"{head}... ({len(value)} long)"
    if (
        isinstance(value, (list, tuple))
        and len(value) <= 8
        and all(v is None or isinstance(v, (bool, int, float)) for v in value)
    ):
        text = "[" + ", ".join(bounded_repr(v, limit) for v in value) + "]"
        if len(text) <= 4 * limit:
            return text
    if isinstance(value, (list, tuple, dict, set)):
        return f"<{type(value).__name__} of {len(value)} items>"
    return f"<{type(value).__name__}>"
