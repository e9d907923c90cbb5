"""Several broadcasters in one communicator (``weightwire_nccl``): a rank's part of the turns.

The transfer group is rank 0, each distinct first owner (ascending) and the inference
workers, all in one NCCL communicator; turn ``src`` is broadcast with root ``src``. An
NCCL broadcast is collective over the whole communicator, so every group trainer rank
takes part in every turn: it broadcasts its own slice and receives-and-drops every
other (``RoundSender.discard``); a member that skipped a turn would hang them all.
Ranks outside the group only iterate their source.

Two activities per group rank, never on the communicator at the same time:

- the caller's thread iterates the source once (its own slice, then the later turns'
  trainer-side gathers, which may be collectives of their own: JAX multi-process
  gathers, FSDP ``full_tensor``) and broadcasts its own slice;
- a driver thread walks the turns in order, receiving the others' slices; at this
  rank's own turn it hands over (``_reached``) and waits for the broadcasts to end
  (``_done``). Rank 0's driver also posts each turn's ``update_weights`` just before
  the turn and waits for it after, so a worker receives one turn at a time.

The first own chunk's tensors are produced while earlier turns are still being
received; packing and its first byte wait for ``_reached``, which keeps the
communicator's order identical on every member. Every wait is bounded (each chunk by
``transfer_s``, each request by ``http_s``); the first failure aborts this rank's
communicator and names its turn.
"""

from __future__ import annotations

import functools
import itertools
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from weightwire.backends.base import Link, Outgoing, RoundAborted, RoundSender, Sent
from weightwire.control.fanout import spawn
from weightwire.shared.errors import TransferTimeout
from weightwire.shared.framing import Chunk
from weightwire.shared.timeouts import Timeouts
from weightwire.trainer.broadcast_plan import BroadcastPlan, Turn
from weightwire.trainer.multi_base import Leading, Ranks, TurnFailure, lead_transfer, ranks_digests
from weightwire.trainer.session import open_wire
from weightwire.trainer.transfer import await_call, chunked

Update = Callable[[Turn], Future]
"""Rank 0: start turn ``turn``'s ``update_weights`` on a side thread."""


@dataclass(eq=False)
class GroupTurns:
    """One round's turns on one group rank; ``failed`` holds the first failure."""

    rank: int
    plan: BroadcastPlan
    chunks: dict[int, list[Chunk]]
    pipeline: RoundSender
    comm: Link
    t: Timeouts
    update: Update | None = None
    """Rank 0: each turn's request, posted just before the turn."""
    stop: threading.Event = field(default_factory=threading.Event)
    failed: list[TurnFailure] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _reached: threading.Event = field(default_factory=threading.Event)
    """Every turn before this rank's own was received."""
    _done: threading.Event = field(default_factory=threading.Event)
    """This rank's own broadcasts ended (or failed)."""

    def fail(self, turn: Turn, exc: BaseException) -> None:
        """Record the first failure and abort: the other members' waits end in their timeouts."""
        with self._lock:
            if not self.failed:
                self.failed.append(TurnFailure(turn, exc))
        self.stop.set()
        self.comm.abort()
        self._reached.set()

    def _bound(self, turn: Turn) -> float:
        """How long a whole turn may take: its request plus one broadcast timeout per chunk."""
        return self.t.http_s + self.t.transfer_s * (len(self.chunks[turn.src]) + 1)

    def run(self, pairs: Iterator[tuple[str, Any]]) -> Sent:
        """This rank's part of every turn; what it sent itself."""
        mine = self.plan.turn_of(self.rank)
        driver = spawn(self._drive, name="weightwire-group-turns")
        sent = Sent(0, 0)
        try:
            if mine is not None:
                # islice: the pipeline must not pull past this turn (the next item's gather
                # may be a collective the other ranks join only after this turn).
                own = chunked(itertools.islice(pairs, len(mine.metas)), self.chunks[mine.src])
                # The first chunk's tensors are pulled before waiting, so this rank joins the
                # earlier turns' trainer-side gathers; it is packed only once the driver is
                # idle, because packing and receiving share the pipeline's slots and streams.
                first = next(own, None)
                self._await_reached(mine)
                prepared = own if first is None else itertools.chain([first], own)
                sent = self.pipeline.send(
                    Outgoing(prepared, self.stop, metas=mine.metas, root=mine.src)
                )
            # Before the later turns' gathers: the driver must receive those turns while this
            # thread joins their gathers, or a collective source would wait on itself.
            self._done.set()
            if not self.stop.is_set():
                for _ in pairs:  # the later turns' gathers; raises on an extra tensor
                    pass
        except BaseException as exc:
            self.fail(mine or self.plan.turns[-1], exc)
        finally:
            self._done.set()
        total = sum(self._bound(t) for t in self.plan.turns)
        try:
            await_call(driver, total, "the group's turns")
        except BaseException as exc:
            self.fail(self.plan.turns[-1], exc)
        return sent

    def _await_reached(self, turn: Turn) -> None:
        earlier = [t for t in self.plan.turns if t.src < turn.src]
        bound = sum(self._bound(t) for t in earlier) + self.t.http_s
        if not self._reached.wait(bound):
            raise TransferTimeout(f"the turns before src {turn.src} did not end within {bound:g} s")
        if self.stop.is_set():
            raise RoundAborted(
                f"the round failed before the turn of trainer rank {turn.rank} (src {turn.src})"
            )

    def _drive(self) -> None:
        for turn in self.plan.turns:
            if self.stop.is_set():
                return
            future = None
            try:
                if self.update is not None:
                    future = self.update(turn)
                    future.add_done_callback(functools.partial(self._failed_call, turn))
                if turn.rank == self.rank:
                    self._reached.set()
                    if not self._done.wait(self._bound(turn)):
                        raise TransferTimeout(
                            f"this rank's own broadcasts did not end within {self._bound(turn):g} s"
                        )
                else:
                    self.pipeline.discard(
                        self.chunks[turn.src], turn.metas, root=turn.src, stop=self.stop
                    )
                if self.stop.is_set():
                    return
                if future is not None:
                    await_call(future, self.t.http_s, "update_weights")
            except BaseException as exc:
                self.fail(turn, exc)
                return
        self._reached.set()

    def _failed_call(self, turn: Turn, future: Future) -> None:
        # A refused request means no worker joins this turn's broadcasts: stop now
        # rather than after a broadcast timeout.
        exc = None if future.cancelled() else future.exception()
        if exc is not None:
            self.fail(turn, exc)


class GroupWire:
    """``MultiSource``'s ``"group"`` wire (a ``multi_base.SeveralWire``): one communicator,
    joined at init, ``GroupTurns`` per round."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks

    def connect(self, bplan: BroadcastPlan, workers: int) -> None:
        """One communicator for the group (see the module docstring, step 1 ``"group"``)."""
        s = self.ranks.session
        t = s.info.timeouts
        backend = s.backend
        size = len(bplan.group_ranks)
        if self.ranks.rank == 0:
            posted = False

            def extend(payload: dict[str, Any]) -> dict[str, Any]:
                nonlocal posted
                out = {**payload, "rank_offset": size}
                self.ranks.exchange.post(
                    "group", {"error": None, "fields": backend.peer_fields(out)}
                )
                posted = True
                return out

            try:
                self.ranks.report("joined", lambda: open_wire(s, extend=extend, trainer_ranks=size))
            except BaseException as exc:
                if not posted:  # the other broadcasters wait for these fields: tell them now
                    self.ranks.exchange.post("group", {"error": f"{type(exc).__name__}: {exc}"})
                raise
            self.ranks.await_all(
                "ready", [r for r in bplan.group_ranks if r != 0], t.connect_s + t.warmup_s
            )
            return
        if not bplan.in_group(self.ranks.rank):
            self.ranks.await_ok("joined", t.connect_s + t.http_s + t.warmup_s)
            return
        comm = None
        try:
            packer = s.framework.device_packer(
                s.info.device
            )  # a rank without a device fails before the rendezvous
            fields = self.ranks.await_ok("group", t.connect_s + t.http_s)["fields"]
            comm = backend.join_peer(
                s.info, fields, rank=bplan.group_ranks.index(self.ranks.rank), timeout=t.connect_s
            )
            comm.warmup(timeout=t.warmup_s)
            s.sender = backend.sender(comm, s.info, s.framework.sender_parts(packer))
        except BaseException as exc:
            if comm is not None:
                comm.abort()
            self.ranks.exchange.post("ready", {"error": f"{type(exc).__name__}: {exc}"})
            raise
        s.link = comm
        self.ranks.exchange.post("ready", {"error": None})
        self.ranks.await_ok("joined", t.http_s + t.warmup_s)

    def _group_turns(
        self, bplan: BroadcastPlan, update: Callable[[Turn], Future] | None = None
    ) -> GroupTurns:
        s = self.ranks.session
        assert s.sender is not None and s.link is not None
        return GroupTurns(
            self.ranks.rank, bplan, self.ranks.chunks, s.sender, s.link, s.info.timeouts, update
        )

    # -- rank 0: the round's wire (``round.Wire``) ----------------------------------------------

    transfer = lead_transfer
    digests = ranks_digests

    def follow(self, bplan: BroadcastPlan, pairs: Iterator[tuple[str, Any]]) -> Sent:
        """A group member takes part in every turn (an NCCL broadcast is collective over the
        communicator); a rank outside the group only joins the gathers."""
        if not bplan.in_group(self.ranks.rank):
            for _ in pairs:  # the turns' gathers; raises on an extra tensor
                pass
            return Sent(0, 0)
        turns = self._group_turns(bplan)
        sent = turns.run(pairs)
        if turns.failed:
            raise self.ranks.turn_error(turns.failed[0])
        return sent

    def _lead(self, leading: Leading, pairs: Iterator[tuple[str, Any]]) -> Sent:
        """Rank 0's transfer over one group: each turn's request, then its collective
        (``multi_group``)."""
        client, bplan = self.ranks.session.client, leading.bplan
        by_src = {t.src: payload for t, payload in zip(bplan.turns, leading.payloads, strict=True)}

        def update(turn: Turn) -> Future:
            return spawn(
                functools.partial(client.update_weights, by_src[turn.src]), name="weightwire-update"
            )

        turns = self._group_turns(bplan, update)
        out = turns.run(pairs)
        leading.failed.extend(turns.failed)
        return out
