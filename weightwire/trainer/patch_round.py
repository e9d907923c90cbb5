"""Delta rounds through a backend that takes patches (``caps.delta``: stock ``sparse_nccl``).

A delta round sends, per changed tensor, a ``shared.patches.SparsePatch``; the backend plans it
(``Backend.plan_patches``: the update info its workers are posted, the wire tensors in
broadcast order) and the round driver (``trainer.round.lead_round``) runs it like any other
round: control plane, the update POST beside the broadcasts, finish, cache reset.

The base rule. A patch is only right on top of the weights it was computed against, and vLLM's
``sparse_nccl`` worker cannot tell which weights it holds (no round token) nor refuse a patch
built on another base; it applies in place, and a round that fails part way leaves some patches
applied. So the trainer keeps, per session, whether it is *sure* of the workers' weights:

- not at the start of a session (the server may hold anything), and not after any round that
  failed before its commit (it may be half applied, or applied on some workers only);
- sure again once a round commits that covers every tensor of the source over every element
  (an *anchor*: ``anchor_patches``), and still sure after each committed round on a sure base.

While it is not sure, ``send_patches`` refuses anything but an anchor with
``SparseBaseUnknown``, before any call to the server.

Generation is paused for every delta round as for any round applied in place
(``gating.in_place_pause``: ``abort`` under ``pause_mode="auto"``), and a round that failed is
not resumed: the servers keep refusing requests rather than serve a half-patched model until
a complete round (the anchor the base rule then requires) commits.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from weightwire.backends.base import PatchPlan, Sent
from weightwire.shared.errors import ConfigError
from weightwire.shared.patches import (
    INDEX_SUFFIX,
    VALUES_SUFFIX,
    Describe,
    EveryIndex,
    SparsePatch,
)
from weightwire.shared.source import WeightSource, checked_iter
from weightwire.trainer.broadcast_plan import BroadcastPlan, Turn
from weightwire.trainer.gating import in_place_pause
from weightwire.trainer.metrics import PhaseClock, RoundMetrics
from weightwire.trainer.round import (
    Round,
    Transmission,
    lead_round,
    send_update,
    was_committed,
)
from weightwire.trainer.session import Session
from weightwire.trainer.transfer import chunked

_SURE: weakref.WeakKeyDictionary[Session, bool] = weakref.WeakKeyDictionary()
"""Per session: the trainer knows the workers' weights (see the module docstring)."""


IN_PLACE = "a stock receiver of patches writes each one into the model as it arrives"


def _no_guard() -> bool:
    # The round guard's release asks the weightwire worker whether its weights are whole; a
    # stock worker cannot answer, so only the pause protects a delta round.
    return False


class SparseBaseUnknown(ConfigError):
    """A delta round was asked while the trainer cannot be sure of the workers' weights (a new
    session, or a round that failed); send an anchor round first. Nothing was sent."""


def base_known(s: Session) -> bool:
    """Whether ``s`` may send a round that is not an anchor."""
    return _SURE.get(s, False)


def _check_against_source(
    s: Session, source: WeightSource, pplan: PatchPlan, patches: Sequence[SparsePatch]
) -> None:
    """Every patch names a tensor of ``source``, with its dtype and shape; without a sure
    base, the round must be an anchor (every tensor of the source, every element)."""
    metas = {m.name: m for m in source.metadata()}
    for p in patches:
        m = metas.get(p.name)
        if m is None:
            raise ConfigError(f"patch {p.name!r} names no tensor of the source")
        if (m.dtype, m.shape) != (p.dtype, tuple(p.shape)):
            raise ConfigError(
                f"patch {p.name!r} declares {p.dtype} {list(p.shape)}, the source's tensor is "
                f"{m.dtype} {list(m.shape)}"
            )
    if base_known(s):
        return
    missing = [name for name in metas if name not in pplan.full]
    if missing:
        raise SparseBaseUnknown(
            f"backend {s.info.backend!r}: the trainer is not sure which weights the workers hold "
            "(no round committed in this session yet, or the last round failed, which can leave "
            "a stock sparse receiver half patched), so a delta would land on an unknown base. "
            f"Send an anchor round first (anchor_patches: every tensor, every element); this "
            f"round leaves out {len(missing)} of {len(metas)} tensors or some of their "
            f"elements, first {missing[0]!r}. Nothing was sent"
        )


class PatchWire:
    """Rank 0 alone sends a ``PatchPlan``: its update POST beside its broadcasts."""

    def __init__(self, s: Session, pplan: PatchPlan) -> None:
        self._s, self._pplan = s, pplan

    def transfer(self, t: Transmission) -> Sent:
        s, pplan = self._s, self._pplan
        pairs = checked_iter(pplan.pairs(), pplan.metas, s.framework.describe)
        return send_update(s, t, chunked(pairs, pplan.chunks), pplan.metas)

    def digests(self, own: dict[str, str]) -> dict[str, str]:
        return own


def refuse_patches(*, group: bool, delta_auto: bool) -> None:
    """``ConfigError`` for an engine that cannot take a caller's patches."""
    if group:
        raise ConfigError("delta rounds have one broadcaster: trainer_init without a group")
    if delta_auto:
        raise ConfigError(
            "delta='auto' extracts the patches itself (send_weights); send_patches is for "
            "delta='off', where the caller extracts them: the engine's base would miss them"
        )


def patch_round(
    s: Session,
    patches: Sequence[SparsePatch],
    version: str,
    clock: PhaseClock,
    *,
    source: WeightSource | None = None,
    before_commit: Callable[[], None] | None = None,
) -> RoundMetrics:
    """Rank 0's delta round of ``patches``; returns once the servers committed ``version``.
    ``source``: the tensors the patches are checked against (default: the session's; an
    overlapped round's snapshot); ``before_commit``: ``Round``'s.

    Refused before any call (``ConfigError``) when the backend takes no patches, when
    ``verify`` is on (the servers' checksums cover whole tensors; a patch round has none to
    compare), for a malformed patch, and without a sure base unless the round is an anchor.
    """
    if not s.backend.caps.delta:
        raise ConfigError(f"backend {s.info.backend!r} sends no delta rounds (patches)")
    if s.verifier is not None:
        raise ConfigError(
            "verify=True compares whole-tensor checksums, which a delta round does not carry: "
            "turn verify off for delta rounds"
        )
    assert s.features is not None
    with clock("metadata"):
        pplan = s.backend.plan_patches(
            list(patches), features=s.features, describe=s.framework.describe
        )
        _check_against_source(s, s.source if source is None else source, pplan, patches)
    bplan = BroadcastPlan((0,), (Turn(0, 0, tuple(pplan.metas)),))
    _SURE[s] = False  # from the first call on, until the commit
    try:
        patches_round = Round(
            version,
            bplan,
            pplan.metas,
            PatchWire(s, pplan),
            payloads=[pplan.update_info],
            pause=in_place_pause(s.info, s.caps, _no_guard, IN_PLACE),
            before_commit=before_commit,
        )
        metrics = lead_round(s, patches_round, clock)
    except BaseException as exc:
        if was_committed(exc):  # finish succeeded; only a check after it failed
            _SURE[s] = True
        raise
    _SURE[s] = True
    return metrics


FlatIndex = Callable[[int, Any], Any]
"""``index(n, like)``: a 1-D ``int32`` array ``0..n-1`` of the framework, where ``like`` is."""


def _whole(name: str, tensor: Any, describe: Describe, index: FlatIndex) -> SparsePatch:
    dtype, shape = describe(tensor)
    every = EveryIndex(math.prod(shape), tensor, index)
    return SparsePatch(name, dtype, tuple(shape), every, tensor.reshape(-1))


def anchor_patches(
    pairs: Any, describe: Describe, arange: Callable[[int], Any]
) -> list[SparsePatch]:
    """Every tensor of ``pairs`` (a source's ``(name, tensor)`` pass) as a patch over all its
    elements: the round that makes the trainer sure of the workers' weights again.
    ``describe``: the framework's (an engine's ``describe``); ``arange(n)``: a 1-D ``int32``
    array ``0..n-1`` of the framework, on the tensors' device (``jnp.arange(n,
    dtype=jnp.int32)``, ``torch.arange(n, dtype=torch.int32, device=...)``)."""
    return [_whole(name, tensor, describe, lambda n, _: arange(n)) for name, tensor in pairs]


def patches_from_wire(
    pairs: Any, describe: Describe, index: FlatIndex, shapes: dict[str, Any]
) -> list[SparsePatch]:
    """A delta round in its generic wire form (``T@index`` then ``T@values`` for a patched
    tensor ``T``, a tensor sent whole under its own name) as patches for a receiver that
    takes nothing else (``sparse_nccl``): a whole tensor becomes a patch over all its
    elements (``index``: the framework's ``flat_index``). ``shapes``: each patched tensor's full
    shape (the source's metadata)."""
    out: list[SparsePatch] = []
    it = iter(pairs)
    for name, tensor in it:
        if not name.endswith(INDEX_SUFFIX):
            out.append(_whole(name, tensor, describe, index))
            continue
        base = name[: -len(INDEX_SUFFIX)]
        values_name, values = next(it, (None, None))
        if values_name != base + VALUES_SUFFIX:
            raise ConfigError(f"wire tensor {name!r} is not followed by {base + VALUES_SUFFIX!r}")
        if base not in shapes:
            raise ConfigError(f"patch {base!r} names no tensor of the source")
        dtype, _ = describe(values)
        out.append(SparsePatch(base, dtype, tuple(shapes[base]), tensor, values))
    return out
