"""Round verification (``verify=True``) against ``/weight_checker``, in one of two modes.

``/weight_checker {"action": "checksum"}`` answers ``{"checksums": {key: sha256hex}}``.
What the keys are decides what can be proven:

- **digest** mode: the keys are the checkpoint names the trainer sends (weightwire's
  reference server; ``replica_checksums`` lists one map per worker replica). Every
  server and replica must hold the sha256 of exactly the bytes sent, for every sent
  tensor. Proves: byte-identical copies everywhere.
- **vllm-diff** mode: the keys are a stock vLLM's ``dp{i}:pp{j}:pcp{k}:tp{l}:<vLLM
  param>``, over *processed* shards (q/k/v fused, TP-sliced, maybe repacked), so no
  digest of ours can match one. The checker is read before and after the round and the
  changes are compared with what the round sent, after mapping checkpoint names to
  vLLM's (``q/k/v_proj`` -> ``qkv_proj``, ``gate/up_proj`` -> ``gate_up_proj``).
  Proves: (a) always, no parameter outside the sent set changed; (b) from the second
  verified round on (when the server still held what the previous round left), every
  parameter fed by a tensor whose bytes changed since that round changed in at least
  one shard, and every parameter fed only by unchanged tensors did not change at all.
  It does not prove the new values are the right ones (a load into the right
  parameter with wrong bytes passes (a) and (b)); digest mode does. Parameters whose
  checksum is that of empty bytes (vLLM on CPU reports repacked linear weights so)
  cannot be observed and are listed, not judged.

A failure is raised as ``VerifyError`` with ``committed=True``: the check runs after
``finish_weight_update`` returned, so the round itself landed, and the message says so.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from weightwire.shared.client import ServerControls
from weightwire.shared.errors import WeightwireError

VLLM_KEY = re.compile(r"^dp\d+:pp\d+:pcp\d+:tp\d+:(.+)$")
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()

# vLLM's loaders fuse these checkpoint projections into one parameter (its
# stacked_params_mapping for Llama/Qwen/Mistral-style decoders).
_STACKED = (
    (".q_proj.", ".qkv_proj."),
    (".k_proj.", ".qkv_proj."),
    (".v_proj.", ".qkv_proj."),
    (".gate_proj.", ".gate_up_proj."),
    (".up_proj.", ".gate_up_proj."),
)


class VerifyError(WeightwireError, RuntimeError):
    """The servers' state disagrees with the round; names the tensors / parameters."""

    def __init__(
        self,
        message: str,
        mismatched: dict[str, list[str]],
        *,
        committed: bool = False,
        weight_version: str | None = None,
    ) -> None:
        if committed:
            message = (
                f"round {weight_version!r} was committed (every worker loaded it and "
                f"finish_weight_update returned), but verification failed: {message}"
            )
        super().__init__(message)
        self.mismatched = mismatched
        self.committed = committed
        self.weight_version = weight_version


@dataclass(frozen=True)
class VerifyReport:
    """What a passed verification established (``proves``), with the counts behind it."""

    mode: str
    proves: str
    checked: int
    unobservable: list[str] = field(default_factory=list)
    unmapped: list[str] = field(default_factory=list)


def vllm_param_name(name: str) -> str:
    """The vLLM parameter a checkpoint tensor loads into (fused projections mapped)."""
    for old, new in _STACKED:
        if old in name:
            return name.replace(old, new, 1)
    return name


def compare_checksums(sent: Mapping[str, str], replies: Sequence[Any]) -> None:
    """Digest mode: raise ``VerifyError`` unless every reply holds ``sent``'s
    digest for every name."""
    if not replies:
        raise VerifyError("weight_checker returned no server replies", {})
    maps: list[tuple[str, dict[str, Any]]] = []
    for i, reply in enumerate(replies):
        got = _checksums(i, reply)
        per_replica = reply.get("replica_checksums")
        if (
            isinstance(per_replica, list)
            and per_replica
            and all(isinstance(m, dict) for m in per_replica)
        ):
            maps += [
                (f"server {i}" + (f" replica {j}" if len(per_replica) > 1 else ""), m)
                for j, m in enumerate(per_replica)
            ]
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
        note = f"; {missing} absent on the server" if missing else ""
        parts.append(
            f"{where}: {len(bad)} of {len(sent)} tensors differ from what was sent: "
            f"{_shown(bad)}{note}"
        )
    if mismatched:
        raise VerifyError("verify failed: " + " | ".join(parts), mismatched)


def _checksums(i: int, reply: Any) -> dict[str, Any]:
    got = reply.get("checksums") if isinstance(reply, dict) else None
    if not isinstance(got, dict):
        raise VerifyError(
            f"server {i} answered weight_checker without a checksums map: {reply!r:.200}", {}
        )
    return got


def _shown(names: Sequence[str]) -> str:
    return ", ".join(names[:8]) + (f" (+{len(names) - 8} more)" if len(names) > 8 else "")


def is_vllm_keyed(replies: Sequence[Any]) -> bool:
    """True when every reply's keys are a stock vLLM's per-shard keys."""
    maps = [_checksums(i, r) for i, r in enumerate(replies)]
    return bool(maps) and all(m and all(VLLM_KEY.match(k) for k in m) for m in maps)


def _param_of(key: str, targets: set[str]) -> str:
    """The vLLM parameter a shard key belongs to (inner-tensor suffixes such as
    ``.qdata`` folded in)."""
    param = VLLM_KEY.match(key).group(1)  # type: ignore[union-attr]
    head = param
    while head not in targets and "." in head:
        head = head.rsplit(".", 1)[0]
    return head if head in targets else param


def diff_round(
    sent: Mapping[str, str],
    before: Sequence[Any],
    after: Sequence[Any],
    previous: Mapping[str, str] | None,
) -> VerifyReport:
    """vllm-diff mode (see the module docstring); ``previous``: last round's sent digests,
    ``None`` when unknown or when the server changed since (then only (a) is checked)."""
    if len(before) != len(after):
        raise VerifyError(
            f"weight_checker answered {len(before)} servers before the round, {len(after)} after",
            {},
        )
    targets = {vllm_param_name(n) for n in sent}
    moved: set[str] | None
    still: set[str] | None
    if previous is not None and set(previous) == set(sent):
        moved = {vllm_param_name(n) for n, d in sent.items() if previous[n] != d}
        still = targets - moved
    else:
        moved = still = None
    mismatched: dict[str, list[str]] = {}
    parts: list[str] = []
    seen: set[str] = set()
    changed_somewhere: set[str] = set()
    unobservable: set[str] = set()
    for i, (b_reply, a_reply) in enumerate(zip(before, after, strict=True)):
        b, a = _checksums(i, b_reply), _checksums(i, a_reply)
        if set(b) != set(a):
            raise VerifyError(
                f"server {i}: the checker's parameter set changed during the round "
                f"({len(set(b) ^ set(a))} keys differ)",
                {},
            )
        outside, frozen = [], []
        for key in sorted(a):
            param = _param_of(key, targets)
            seen.add(param)
            if a[key] == EMPTY_SHA256 and b[key] == EMPTY_SHA256:
                unobservable.add(param)
                continue
            changed = a[key] != b[key]
            if changed and param not in targets:
                outside.append(key)
            if changed:
                changed_somewhere.add(param)
            if still is not None and changed and param in still:
                frozen.append(key)
        if outside:
            mismatched[f"server {i} (not sent, changed)"] = outside
            parts.append(
                f"server {i}: {len(outside)} parameters the round did not send changed: "
                f"{_shown(outside)}"
            )
        if frozen:
            mismatched[f"server {i} (sent unchanged bytes, changed)"] = frozen
            parts.append(
                f"server {i}: {len(frozen)} parameters changed although every tensor feeding them "
                f"was sent with the same bytes as last round: {_shown(frozen)}"
            )
    if moved is not None:
        missed = sorted(
            p for p in moved if p in seen and p not in changed_somewhere and p not in unobservable
        )
        if missed:
            mismatched["all servers (sent new bytes, unchanged)"] = missed
            parts.append(
                f"{len(missed)} parameters fed by tensors whose bytes changed since the last round "
                f"did not change on any shard: {_shown(missed)}"
            )
    if parts:
        raise VerifyError("verify (vllm-diff) failed: " + " | ".join(parts), mismatched)
    unmapped = sorted(n for n in sent if vllm_param_name(n) not in seen)
    proves = "no parameter outside the sent set changed"
    if moved is not None:
        proves += (
            "; every parameter fed by changed tensors changed on some shard, and none fed only by "
            "unchanged tensors did"
        )
    else:
        proves += " (baseline round: change detection starts with the next verified round)"
    return VerifyReport("vllm-diff", proves, len(seen), sorted(unobservable), unmapped)


class RoundVerifier:
    """Per-engine verification state: the checker before the round and the last round's digests."""

    def __init__(self) -> None:
        self._before: list[Any] | None = None
        self._previous: dict[str, str] | None = None
        self._last_after: list[Any] | None = None
        self._keyed: bool | None = None

    def vllm_keyed(self, client: ServerControls) -> bool:
        """Whether the servers' checker is per vLLM shard (vllm-diff mode), asked once (a
        sliced round can be checked only there: its digests are of the slices it sent)."""
        if self._keyed is None:
            self._keyed = is_vllm_keyed(list(client.weight_checker("checksum")))
        return self._keyed

    def forget_previous(self) -> None:
        """The next round's digests are not comparable with the last one's (a sliced
        round's plan was rebuilt): change detection restarts from it."""
        self._previous = None

    def before_round(self, client: ServerControls) -> None:
        """Snapshot the checker; called before ``start_weight_update`` (a failure
        here sent nothing)."""
        self._before = list(client.weight_checker("checksum"))

    def after_round(
        self,
        client: ServerControls,
        sent: dict[str, str],
        weight_version: str,
        *,
        draft: bool = False,
    ) -> VerifyReport:
        """Check the committed round; any failure is a ``VerifyError`` with ``committed=True``.

        A draft round loads into the speculative draft model, which ``/weight_checker``
        does not cover: it is checked as "the target model did not change"."""
        before, self._before = self._before, None
        try:
            after = list(client.weight_checker("checksum"))
            if draft:
                if before is None:
                    raise VerifyError("no weight_checker snapshot was taken before the round", {})
                if is_vllm_keyed(after):
                    diff_round({}, before, after, None)
                elif before != after:
                    raise VerifyError(
                        "the target model's checksums changed during a draft round", {}
                    )
                return VerifyReport(
                    "draft",
                    "the target model did not change (the checker does not cover the "
                    "draft model, so its new values are not checked)",
                    0,
                )
            if is_vllm_keyed(after):
                if before is None:
                    raise VerifyError("no weight_checker snapshot was taken before the round", {})
                # Change detection needs the server to have held last round's result.
                previous = self._previous if self._last_after == before else None
                report = diff_round(sent, before, after, previous)
            else:
                compare_checksums(sent, after)
                report = VerifyReport(
                    "digest",
                    "every server and replica holds byte-identical copies of every sent tensor",
                    len(sent),
                )
        except VerifyError as exc:
            self._previous = self._last_after = None
            raise VerifyError(
                str(exc), exc.mismatched, committed=True, weight_version=weight_version
            ) from None
        except Exception as exc:  # a 404 / transport error from the checker itself
            self._previous = self._last_after = None
            raise VerifyError(
                f"weight_checker failed after the round: {type(exc).__name__}: {exc}",
                {},
                committed=True,
                weight_version=weight_version,
            ) from exc
        self._previous, self._last_after = dict(sent), after
        return report
