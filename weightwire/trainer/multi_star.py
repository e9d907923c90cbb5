"""Several broadcasters over stars (``SenderCaps.several == "stars"``: ``weightwire_tcp``).

Each non-zero broadcaster opens its own star (``Backend.open_star``) and publishes the
endpoint over the trainer group (address and a key share: its secret is agreed with
rank 0, never posted; ``shared.keyshare``); rank 0's init info lists them all
(``Backend.with_stars``) and every worker dials every star. In a round, rank 0 posts
the turns' ``update_weights`` one after another on a side thread; a broadcaster's first
byte waits for its turn's "go" (``_await_go``), so bytes queued behind earlier turns do
not run down its per-broadcast timeout.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

from weightwire.backends.base import Outgoing, Sent, StarEndpoint, StarSource
from weightwire.control.fanout import spawn
from weightwire.shared.errors import ConfigError
from weightwire.shared.info import TCP_SECRET_BYTES
from weightwire.shared.keyshare import KeyShare
from weightwire.trainer.broadcast_plan import BroadcastPlan, Turn
from weightwire.trainer.multi_base import (
    Leading,
    Ranks,
    RoundFailed,
    TurnFailure,
    lead_transfer,
    ranks_digests,
)
from weightwire.trainer.multi_sliced import decode_hellos, encode_hellos
from weightwire.trainer.session import open_wire
from weightwire.trainer.sliced import Slicing
from weightwire.trainer.transfer import await_call, chunked

_STAR_CONTEXT = b"weightwire-tcp-star/1"


class StarWire:
    """``MultiSource``'s ``"stars"`` wire (a ``multi_base.SeveralWire``): a star per
    broadcaster, opened at init."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks

    def connect(self, bplan: BroadcastPlan, workers: int, *, sliced: bool = False) -> None:
        """Rank 0 and each other broadcaster agree that star's secret by key shares posted on
        the trainer group's store (``shared.keyshare``): the store holds public values only,
        and the secret reaches the workers inside rank 0's init POST alone. ``sliced``:
        every rank is a sender of sliced rounds (``multi_sliced``): the workers tell their
        wants on rank 0's star and rank 0 posts them for the others."""
        s = self.ranks.session
        t = s.info.timeouts
        share = KeyShare.new()
        if self.ranks.rank == 0:
            self.ranks.exchange.post("keyshare", share.public_b64)

            def extend(payload: dict[str, Any]) -> dict[str, Any]:
                stars = [
                    self._source(share, self.ranks.exchange.get("endpoint", r, t.connect_s), r)
                    for r in bplan.group_ranks[1:]
                ]
                return s.backend.with_stars(
                    payload,
                    stars,
                    rank_offset=len(bplan.group_ranks),
                    world_size=bplan.world_size(workers),
                )

            self.ranks.report("joined", lambda: open_wire(s, extend=extend, several_slice=sliced))
            self.ranks.await_all(
                "ready", [r for r in bplan.group_ranks if r != 0], t.connect_s + t.warmup_s
            )
            if sliced:
                hellos = [] if s.slicing is None else s.slicing.hellos
                self.ranks.exchange.post("hellos", encode_hellos(hellos))
            return
        if bplan.turn_of(self.ranks.rank) is None:
            self.ranks.await_ok("joined", t.connect_s + t.http_s + t.warmup_s)
            return
        rdv: StarEndpoint | None = None
        try:
            secret = share.secret_with(
                self.ranks.exchange.get("keyshare", 0, t.connect_s),
                length=TCP_SECRET_BYTES,
                context=_STAR_CONTEXT,
            )
            rdv = s.backend.open_star(s.info, world_size=1 + workers, secret=secret)
            self.ranks.exchange.post(
                "endpoint", {"host": rdv.host, "port": rdv.port, "keyshare": share.public_b64}
            )
            comm = rdv.accept(timeout=t.connect_s)
        except BaseException as exc:
            if rdv is not None:
                rdv.close()
            self.ranks.exchange.post("ready", {"error": f"{type(exc).__name__}: {exc}"})
            raise
        try:
            comm.warmup(timeout=t.warmup_s)
        except BaseException as exc:
            comm.abort()
            self.ranks.exchange.post("ready", {"error": f"{type(exc).__name__}: {exc}"})
            raise
        s.link = comm
        s.sender = s.backend.sender(comm, s.info, s.framework.sender_parts(None))
        self.ranks.exchange.post("ready", {"error": None})
        self.ranks.await_ok("joined", t.http_s)
        if sliced:
            hellos = decode_hellos(self.ranks.exchange.get("hellos", 0, t.http_s))
            if hellos:  # none: rank 0 asked no wants, rounds are broadcasts
                s.slicing = Slicing(
                    hellos,
                    s.backend.sliced_sender(comm, s.info),
                    several=True,
                    partial=s.info.partial,
                )

    @staticmethod
    def _source(share: KeyShare, endpoint: Any, rank: int) -> StarSource:
        """A broadcaster's posted endpoint -> its entry in rank 0's init info (the
        secret derived here)."""
        if not isinstance(endpoint, dict):
            raise ConfigError(f"trainer rank {rank} posted an endpoint that is not an object")
        secret = share.secret_with(
            endpoint.get("keyshare"), length=TCP_SECRET_BYTES, context=_STAR_CONTEXT
        )
        return StarSource(endpoint.get("host"), endpoint.get("port"), secret)  # type: ignore[arg-type]

    def _send_turn(
        self, turn: Turn, pairs: Iterator[tuple[str, Any]], stop: threading.Event
    ) -> Sent:
        pipeline = self.ranks.session.sender
        assert pipeline is not None
        # islice: the pipeline must not pull past this turn (the next item may be a
        # later turn's gather, which can wait on a broadcaster blocked until its turn).
        mine = itertools.islice(pairs, len(turn.metas))
        begin = None if turn.rank == 0 else (lambda: self._await_go(turn))
        return pipeline.send(
            Outgoing(chunked(mine, self.ranks.chunks[turn.src]), stop, begin, metas=turn.metas)
        )

    def _await_go(self, turn: Turn) -> None:
        """A broadcaster's first byte waits for its turn's request (its first chunk is
        packed meanwhile): bytes queued behind earlier turns would run down the
        per-broadcast timeout for as long as those turns take."""
        t = self.ranks.session.info.timeouts
        go = self.ranks.exchange.get(f"go{turn.src}", 0, t.http_s * (turn.src + 1) + t.transfer_s)
        if not go:
            raise RoundFailed(
                f"trainer rank 0 ended the round before the turn of rank {turn.rank} "
                f"(src {turn.src})"
            )

    # -- rank 0: the round's wire (``round.Wire``) ----------------------------------------------

    transfer = lead_transfer
    digests = ranks_digests

    def follow(self, bplan: BroadcastPlan, pairs: Iterator[tuple[str, Any]]) -> Sent:
        """A broadcaster sends its slice on its own star once its turn's request is out;
        every rank then joins the later turns' gathers."""
        turn = bplan.turn_of(self.ranks.rank)
        sent = Sent(0, 0)
        if turn is not None:
            sent = self._send_turn(turn, pairs, threading.Event())
        for _ in pairs:  # the later turns' gathers; raises on an extra tensor
            pass
        return sent

    def _lead(self, leading: Leading, pairs: Iterator[tuple[str, Any]]) -> Sent:
        """Rank 0's transfer over stars: its own slice on its star, the turns'
        requests beside it."""
        s = self.ranks.session
        t = s.info.timeouts
        stop = threading.Event()
        self.ranks.went = set()
        sent = Sent(0, 0)
        turns = spawn(lambda: self._run_turns(leading, stop), name="weightwire-turns")
        bplan, failed = leading.bplan, leading.failed
        mine = bplan.turn_of(0)
        try:
            if mine is not None:
                sent = self._send_turn(mine, pairs, stop)
            for _ in pairs:
                pass
        except BaseException as exc:
            if not failed:
                failed.append(TurnFailure(mine or bplan.turns[0], exc))
            stop.set()
            if s.link is not None:
                s.link.abort()
        _wait(turns, t.http_s * (len(bplan.turns) + 1))
        return sent

    def _run_turns(self, leading: Leading, stop: threading.Event) -> None:
        """The turns' ``update_weights``, one after another (a worker receives
        one turn at a time)."""
        s = self.ranks.session
        t = s.info.timeouts
        for turn, payload in zip(leading.bplan.turns, leading.payloads, strict=True):
            if stop.is_set():
                return
            self.ranks.go(turn, True)
            try:
                _wait(
                    spawn(
                        functools.partial(s.client.update_weights, payload),
                        name="weightwire-update",
                    ),
                    t.http_s,
                )
            except BaseException as exc:
                leading.failed.append(TurnFailure(turn, exc))
                stop.set()
                if s.link is not None:
                    s.link.abort()  # rank 0's own send may be blocked on a worker that gave up
                return


def _wait(future: Future, timeout: float) -> Any:
    return await_call(future, timeout, "update_weights")
