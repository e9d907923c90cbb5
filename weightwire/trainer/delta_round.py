"""Rank 0's round with ``delta="auto"``: dense or delta, its base bookkeeping, and the dense
retry when a worker refuses the base (``trainer.delta`` holds the base and builds the round).

Per round: a fresh ``round_token``; dense (the first round, an anchor, ``dense=True``, the
round after a failure, a changed source) streams the source as usual and snapshots each
tensor into the base; otherwise the base is compared with the source on the device and
the round carries only the changed tensors and patches, with ``delta_base``. The base is
adopted once the round committed and dropped by any failure. A worker that holds another
round refuses a delta round before any byte (``DeltaBaseMismatch``): the same round is then
sent dense at once, in the same call, over a reopened wire (the refusal aborted it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from weightwire.shared.errors import is_delta_base_mismatch
from weightwire.shared.meta import ParamMeta
from weightwire.shared.source import WeightSource
from weightwire.trainer.delta import DeltaRound, DeltaTracker
from weightwire.trainer.metrics import PhaseClock, RoundMetrics
from weightwire.trainer.patch_round import patch_round, patches_from_wire
from weightwire.trainer.session import Session
from weightwire.trainer.snapshot import rewrapped
from weightwire.trainer.sole_round import SoleRounds
from weightwire.trainer.transfer import tensor_stream

logger = logging.getLogger(__name__)

Remap = Callable[[dict[str, str]], dict[str, str]]


@dataclass(frozen=True)
class _Ask:
    """What the caller asked of one round: read ``source`` (its ``metas``), commit
    ``version``; ``before_commit``: an overlapped round's last chance to be stopped."""

    source: WeightSource
    metas: list[ParamMeta]
    version: str
    before_commit: Callable[[], None] | None


class _WireSource(WeightSource):
    """A delta round's wire tensors, built and checked already."""

    def __init__(self, built: DeltaRound) -> None:
        self._built = built

    def metadata(self) -> list[ParamMeta]:
        return list(self._built.metas)

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self._built.pairs)

    def checks_own_stream(self, metas: Sequence[ParamMeta]) -> bool:
        return metas is self._built.metas or self._built.metas == metas


class _Snapshotting(WeightSource):
    """A dense round's source: ``inner``'s stream (its own grouping kept), each tensor
    copied into the base as it is sent."""

    def __init__(self, inner: WeightSource, tracker: DeltaTracker, metas: list[ParamMeta]):
        self._inner, self._tracker, self._metas = inner, tracker, metas

    def metadata(self) -> list[ParamMeta]:
        return self._inner.metadata()

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return self._tracker.snapshot_stream(tensor_stream(self._inner), self._metas)

    def held_names(self) -> set[str] | None:
        return self._inner.held_names()

    def checks_own_stream(self, metas: Sequence[ParamMeta]) -> bool:
        return self._inner.checks_own_stream(metas)


class DeltaRounds:
    """Sends rank 0's rounds of one engine with ``delta="auto"``."""

    def __init__(
        self,
        session: Session,
        tracker: DeltaTracker,
        sole_round: SoleRounds,
        reopen: Callable[[], None],
        sha: Callable[[Any], str],
    ) -> None:
        self._s, self.tracker = session, tracker
        self._sole_round, self._reopen, self._sha = sole_round, reopen, sha

    def send(
        self,
        source: WeightSource,
        metas: list[ParamMeta],
        version: str,
        clock: PhaseClock,
        *,
        dense: bool,
        before_commit: Callable[[], None] | None = None,
    ) -> RoundMetrics:
        """One round of ``source`` (``before_commit``: an overlapped round's, ``Round``'s)."""
        slicing = self._s.slicing
        if slicing is not None and slicing.slices(metas):
            # compared and snapshotted where each shard lives, as a sliced round reads it: a
            # sharded array is never gathered (its base stays sharded, ``jax_side.shard_delta``)
            source = rewrapped(source, self._s.framework.sliced_source)
        ask = _Ask(source, metas, version, before_commit)
        try:
            return self._round(ask, clock, dense)
        except BaseException as exc:
            if dense or not is_delta_base_mismatch(exc):
                raise
            logger.warning(
                "a worker does not hold the round the patches were built on (%s); "
                "sending round %s dense",
                exc,
                version,
            )
        self._reopen()
        return self._round(ask, PhaseClock(), True)

    def _round(self, ask: _Ask, clock: PhaseClock, dense: bool) -> RoundMetrics:
        s, tracker, metas = self._s, self.tracker, ask.metas
        token = tracker.next_token()
        built: DeltaRound | None = None
        try:
            if not tracker.wants_dense(metas, forced=dense):
                with clock("extract"):
                    pairs = s.stream(ask.source, tensor_stream(ask.source), metas, None)
                    built = tracker.build(pairs, metas)
            metrics = self._send(ask, clock, token, built)
        except BaseException:
            tracker.drop()  # the workers' state is unknown: the next round is dense
            raise
        is_dense = built is None or not built.entries
        tracker.adopt(token, dense=is_dense)
        return replace(
            metrics,
            dense_bytes=sum(m.nbytes for m in metas),
            density=None if built is None else built.density,
            extract_seconds=clock.seconds.get("extract", 0.0),
        )

    def _send(
        self, ask: _Ask, clock: PhaseClock, token: str, built: DeltaRound | None
    ) -> RoundMetrics:
        s, metas = self._s, ask.metas
        if s.backend.caps.delta:  # a receiver of patches only (stock sparse_nccl)
            return self._send_patches(ask, clock, built)
        fields: dict[str, Any] = {"round_token": token}
        remap: Remap | None = None
        source: WeightSource
        wire: Sequence[ParamMeta]
        if built is None:
            source, wire = _Snapshotting(ask.source, self.tracker, metas), metas
        else:
            source, wire = _WireSource(built), built.metas
            if built.entries:
                fields["delta_base"] = self.tracker.token
                fields["patches"] = built.entries
                remap = self._remapper(built)
        return self._sole_round(
            wire,
            ask.version,
            clock,
            False,
            source=source,
            fields=fields,
            remap=remap,
            before_commit=ask.before_commit,
        )

    def _send_patches(self, ask: _Ask, clock: PhaseClock, built: DeltaRound | None) -> RoundMetrics:
        """The round as patches only: a tensor sent whole becomes a patch of every element
        (a dense round is the anchor ``trainer.patch_round`` asks for). No round token: the
        receiver has none; the base rule stands in for it."""
        s, metas = self._s, ask.metas
        if built is None:
            pairs = self.tracker.snapshot_stream(
                s.stream(ask.source, tensor_stream(ask.source), metas, None), metas
            )
        else:
            pairs = iter(built.pairs)
        shapes = {m.name: m.shape for m in metas}
        patches = patches_from_wire(pairs, s.framework.describe, s.framework.flat_index, shapes)
        return patch_round(
            s, patches, ask.version, clock, source=ask.source, before_commit=ask.before_commit
        )

    def _remapper(self, built: DeltaRound) -> Remap:
        """``verify``: the workers digest a patched tensor whole, so the trainer does too."""

        def remap(own: dict[str, str]) -> dict[str, str]:
            wire = {n for p in built.patches for n in (p.index_name, p.values_name)}  # verify only
            out = {n: d for n, d in own.items() if n not in wire}
            out.update({name: self._sha(base) for name, base in built.patched.items()})
            return out

        return remap
