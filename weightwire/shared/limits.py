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


LIMITS = Limits()
