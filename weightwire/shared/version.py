"""Server-version gates as data: which wire features a vLLM release understands.

One table instead of ``if version >= ...`` scattered through engines, so a new gate
is one row and every engine reads the same answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from weightwire.shared.limits import bounded_repr

# (first version with the feature, feature name, what changed)
VERSION_GATES: tuple[tuple[tuple[int, int], str, str], ...] = (
    ((0, 28), "packed_in_init", "packed / buffer geometry travel in the init info, not per round"),
    ((0, 30), "unique_id_rendezvous", "nccl_unique_id_b64 rendezvous for torch-free trainers"),
    ((0, 32), "shutdown_route", "POST /shutdown_weight_transfer_engine exists"),
    ((0, 33), "reuse_metadata", "empty update-info lists reuse the previous round's metadata"),
)

# Digit runs are bounded so int() never meets a 5000-digit "version".
_VERSION_RE = re.compile(r"^\s*v?(\d{1,9})\.(\d{1,9})(?!\d)")


def parse_version(text: str) -> tuple[int, int]:
    """``"0.33.1.dev4+gabc"`` -> ``(0, 33)``; anything unparsable raises ``ValueError``."""
    match = _VERSION_RE.match(text) if isinstance(text, str) else None
    if match is None:
        raise ValueError(f"cannot parse server version {bounded_repr(text)}")
    return int(match.group(1)), int(match.group(2))


@dataclass(frozen=True)
class ServerFeatures:
    version: str
    packed_in_init: bool
    unique_id_rendezvous: bool
    shutdown_route: bool
    reuse_metadata: bool

    @classmethod
    def for_version(cls, version: str) -> ServerFeatures:
        have = parse_version(version)
        flags = {name: have >= first for first, name, _ in VERSION_GATES}
        return cls(version=version, **flags)

    def require(self, feature: str, why: str) -> None:
        if not getattr(self, feature):
            first = next(f for f, name, _ in VERSION_GATES if name == feature)
            raise ValueError(
                f"server version {self.version} lacks {feature} (needs >= {first[0]}.{first[1]}): {why}"
            )
