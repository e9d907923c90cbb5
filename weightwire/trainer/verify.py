"""Round verification: the servers' per-tensor sha256 against what rank 0 sent.

``/weight_checker {"action": "checksum"}`` answers ``{"checksums": {name: sha256hex}}``
(the weightwire reference server and plugin key them by the checkpoint names the
trainer sends). Every server must match every sent tensor: a replica that loaded
garbage is exactly the silent failure this check exists to catch. A reply that also
lists ``replica_checksums`` (the reference server, one map per worker replica) has
each replica checked, not just the first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class VerifyError(RuntimeError):
    """A server holds different bytes than the trainer sent; names the tensors."""

    def __init__(self, message: str, mismatched: dict[str, list[str]]) -> None:
        super().__init__(message)
        self.mismatched = mismatched


def compare_checksums(sent: Mapping[str, str], replies: Sequence[Any]) -> None:
    """Raise ``VerifyError`` unless every reply holds ``sent``'s digest for every name."""
    if not replies:
        raise VerifyError("weight_checker returned no server replies", {})
    maps: list[tuple[str, dict[str, Any]]] = []
    for i, reply in enumerate(replies):
        got = reply.get("checksums") if isinstance(reply, dict) else None
        if not isinstance(got, dict):
            raise VerifyError(f"server {i} answered weight_checker without a checksums map: {reply!r:.200}", {})
        per_replica = reply.get("replica_checksums")
        if isinstance(per_replica, list) and per_replica and all(isinstance(m, dict) for m in per_replica):
            maps += [(f"server {i}" + (f" replica {j}" if len(per_replica) > 1 else ""), m) for j, m in enumerate(per_replica)]
        else:
            maps.append((f"server {i}", got))
    mismatched: dict[str, list[str]] = {}
    parts = []
    for where, got in maps:
        bad = [name for name, digest in sent.items() if got.get(name) != digest]
        if not bad:
            continue
        mismatched[where] = bad
        missing = sum(1 for n in bad if n not in got)
        shown = ", ".join(bad[:8]) + (f" (+{len(bad) - 8} more)" if len(bad) > 8 else "")
        note = f"; {missing} absent on the server" if missing else ""
        parts.append(f"{where}: {len(bad)} of {len(sent)} tensors differ from what was sent: {shown}{note}")
    if mismatched:
        raise VerifyError("verify failed: " + " | ".join(parts), mismatched)
