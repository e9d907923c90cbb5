"""Sliced rounds from several trainer processes (a ``TrainerGroup`` over ``weightwire_tcp``).

It applies where the source names no broadcasters (no ``ParamMeta.owners``: without
slicing rank 0 would send alone) and the session asks for wants (``sliced="auto"``).
At init every trainer process opens a star (``multi_star.StarWire.connect`` with every rank
a sender) and the workers tell their wants on rank 0's; rank 0 posts the hellos over the
group, so every process holds the same ``trainer.sliced.Slicing``. In a round:

1. every process reads its source's tensors where they are held (``sliced_source``: no
   gather) and says what its own rank holds of them (``merge``: a ``jax.Array``'s or
   DTensor's sharding, a plain tensor whole); every process builds the slice plan from
   the union: the same inputs give the same plan (``slice_plan``'s order is deterministic);
   the processes compare the plan's digest (``agree``) before any call, and a process that
   could not build it names itself on every rank;
2. rank 0 runs the round as one sender does (``sole_round.SoleRounds``: the control plane, the
   ``sliced`` update POST, its own pieces) and posts "go" once its control plane ran
   (``began``); each other process waits for it (bounded), then sends each worker the pieces
   ``plan.of_rank(rank)`` gives it, read from its own addressable shards, on its own star;
3. each worker reads every sender's frames until each one's last and checks their union
   against its wants (``Cover``): all or nothing, as with one sender;
4. rank 0 posts the verdict (``MultiSource.committed`` / ``failed``); every process returns
   or raises with it.

Failure rules: a process that fails aborts its star, so each worker's receive fails at once
and the round fails on every worker (nothing commits); rank 0's round then fails and its
verdict tells the others; a rank 0 that fails before its "go" posts a refusal instead, so
no process waits longer than its timeouts. A round refused on every process before any byte
(rank 0's "go" refused, the plan agreement refused) keeps every engine where rank 0 keeps its
own (a refused start); once the "go" was posted every process breaks (bytes may be out).
"""

from __future__ import annotations

import base64
import contextlib
import json
import threading
from collections.abc import Iterable
from hashlib import sha256
from typing import Any, cast

from weightwire.backends.base import Outgoing, Prepared, Sent
from weightwire.shared.meta import ParamMeta
from weightwire.shared.slices import Box
from weightwire.trainer.group import GroupTimeout
from weightwire.trainer.multi_base import Ranks, RoundFailed
from weightwire.trainer.slice_plan import Held, Holdings, SlicePlan, SlicePlanError
from weightwire.trainer.sliced import Slicing, pieces, plan_digest
from weightwire.trainer.sole_round import sliced_round
from weightwire.trainer.transfer import tensor_stream

_GRACE_S = 2.0  # how long a sender that was refused its "go" waits for rank 0's account


def _everywhere(message: str) -> SlicePlanError:
    """The agreement's refusal: every process raises it, before any byte."""
    refused = SlicePlanError(message)
    refused.everywhere = True
    return refused


def slices_across(ranks: Ranks) -> bool:
    """Sliced rounds from every process of the group: the session asks for wants, the
    backend carries a star per sender, and there are several processes (the same answer on
    every rank: settings only)."""
    s = ranks.session
    caps = s.backend.caps
    return (
        s.info.sliced == "auto"
        and caps.sliced
        and caps.several == "stars"
        and ranks.exchange.group.size > 1
    )


def encode_hellos(hellos: list[bytes]) -> list[str]:
    return [base64.b64encode(h).decode("ascii") for h in hellos]


def decode_hellos(posted: Any) -> list[bytes]:
    if not isinstance(posted, list) or not all(isinstance(h, str) for h in posted):
        raise SlicePlanError("trainer rank 0 posted the workers' wants in an unknown form")
    return [base64.b64decode(h) for h in posted]


class SeveralSlicing:
    """This process's part of the group's sliced rounds (the module docstring)."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self.in_flight = False
        """Rank 0: a sliced round's plan was agreed on this round."""
        self.went = False
        """Rank 0: this round's "go" (or its refusal) was posted."""
        self.opened = False
        """Rank 0: this round's "go" was posted: the other processes may have written."""
        self._held: tuple[list[str], Holdings] | None = None
        """The processes' holdings digests last exchanged, and their union."""

    def attach(self, slicing: Slicing) -> None:
        slicing.merge = self.merge
        slicing.agree = self.agree
        if self.ranks.rank == 0:
            slicing.began = self.began

    def new_round(self) -> None:
        self.in_flight = self.went = self.opened = False

    # -- every rank -------------------------------------------------------------------------

    def merge(self, holdings: Holdings) -> Holdings:
        """The union of what each process says it holds itself (its own rank's boxes: a
        ``jax.Array``'s sharding tells every process's, a plain tensor only its holder's).
        Every round the processes compare a digest of theirs; the boxes themselves cross
        the group only when a digest changed."""
        x = self.ranks
        rank, timeout = x.rank, x.session.info.timeouts.http_s
        mine = sorted(
            [h.tensor, [list(r) for r in h.box.ranges]]
            for hs in holdings.held.values()
            for h in hs
            if h.rank == rank
        )
        shapes = {n: list(s) for n, s in holdings.shapes.items()}
        digest = sha256(json.dumps([shapes, mine]).encode()).hexdigest()[:32]
        digests = x.exchange.allgather("slice_held_digest", digest, timeout)
        if self._held is None or self._held[0] != digests:
            told = x.exchange.allgather("slice_held", mine, timeout)
            held = [
                Held(name, r, Box(tuple((int(lo), int(hi)) for lo, hi in ranges)))
                for r, boxes in enumerate(told)
                for name, ranges in boxes
            ]
            self._held = (digests, Holdings.of(holdings.shapes, held))
        return self._held[1]

    def agree(self, plan: SlicePlan | None, error: str | None) -> None:
        """Every process built the same plan (its digest), or every one raises naming the
        process that could not."""
        self.in_flight = True
        mine = {"digest": None if plan is None else plan_digest(plan), "error": error}
        x = self.ranks
        values = x.exchange.allgather("slice_plan", mine, x.session.info.timeouts.http_s)
        for r, v in enumerate(values):
            if v.get("error"):
                raise _everywhere(f"trainer rank {r} could not build the slice plan: {v['error']}")
        differ = [r for r, v in enumerate(values) if v.get("digest") != values[0].get("digest")]
        if differ:
            raise _everywhere(
                f"trainer ranks {differ} built another slice plan than rank 0: the processes "
                "must see the same tensors (names, shapes, dtypes, shardings); pass "
                "TrainerInitInfo(sliced='off') to broadcast"
            )

    # -- rank 0 -----------------------------------------------------------------------------

    def began(self) -> None:
        """Rank 0's control plane ran: the other processes may send."""
        self.went = self.opened = True
        self.ranks.exchange.post("slice_go", True)

    def release(self) -> None:
        """Rank 0's round ended before its "go": the others stop waiting for it."""
        if self.in_flight and not self.went:
            self.went = True
            self.ranks.exchange.post("slice_go", False)

    # -- the other ranks --------------------------------------------------------------------

    def _await_go(self) -> None:
        t = self.ranks.session.info.timeouts
        x = self.ranks
        if not x.exchange.get("slice_go", 0, 2 * t.http_s + t.transfer_s):
            why, kept = "", False
            with contextlib.suppress(GroupTimeout):  # rank 0 posts its verdict right after
                verdict = x.exchange.get("verdict", 0, _GRACE_S)
                why, kept = f": {verdict.get('error')}", bool(verdict.get("kept"))
            refused = RoundFailed(
                f"trainer rank 0 ended the sliced round before its first byte{why}"
            )
            refused.kept_before_any_byte = kept
            raise refused

    def kept_before_any_byte(self, exc: BaseException) -> bool:
        """A non-zero rank's sliced round failed before any process wrote a byte, on every
        rank at once (rank 0 refused its "go", or the processes' plan agreement refused the
        round), and rank 0 kept its engine: this rank keeps its own too, its star unaborted,
        as a broadcast round's refused start leaves every rank usable (was: every rank broke,
        though no worker had received anything)."""
        if isinstance(exc, RoundFailed):
            return exc.kept_before_any_byte
        if isinstance(exc, SlicePlanError) and exc.everywhere:
            with contextlib.suppress(GroupTimeout):  # rank 0 raised it too: its verdict follows
                return bool(self.ranks.exchange.get("verdict", 0, _GRACE_S).get("kept"))
        return False

    def follow(self, metas: list[ParamMeta], draft: bool) -> Sent | None:
        """A non-zero rank's part of a sliced round: its pieces on its own star (``None``:
        this round is not sliced; the caller iterates the source as for a broadcast)."""
        s = self.ranks.session
        slicing = s.slicing
        if (
            slicing is None
            or not slicing.slices(metas)
            or not sliced_round(s, slicing, draft=draft, fields=None)
        ):
            return None
        source = s.framework.sliced_source(s.source)  # tensors left where they are held
        tensors = dict(s.stream(source, tensor_stream(source), metas, None))
        rank = self.ranks.rank
        plan = slicing.plan(metas, s.framework.slice_holdings(tensors), rank)
        prepared = pieces(
            plan,
            metas,
            tensors,
            rank=rank,
            read=s.framework.read_box,
            buffer_bytes=s.info.packed_buffer_size_bytes,
        )
        # a sliced sender's prepared items are each tensor's pieces (``SlicePiece``)
        outgoing = Outgoing(
            cast(Iterable[Prepared], prepared), threading.Event(), self._await_go, metas=metas
        )
        return slicing.sender.send(outgoing)


__all__ = ["SeveralSlicing", "decode_hellos", "encode_hellos", "slices_across"]
