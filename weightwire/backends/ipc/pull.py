"""``IPCPullPipeline``: rank 0's one-copy data path of ``weightwire_ipc``.

Used in pull mode, for packed rounds only.

The trainer writes each chunk straight into the worker's own receive buffer
(``backends.ipc.pool.ReceivePool``): one ``cudaMemcpyAsync`` per tensor on the fill
stream, one device copy per byte, in the trainer's context only, and no slot ring on
this side (trainer-side extra memory ~0). Per chunk, one small JSON message each way:

- worker -> trainer ``{"op": "want", "c": chunk, "b": buffer id, "n": bytes}``, with
  ``"cap"`` (its size), ``"h"`` (its ``cudaIpcMemHandle_t``) and ``"f"`` (its free
  event) the first time the session names buffer ``b``, every later chunk checked
  against ``cap``; the worker records that free event (after the buffer's
  previous readers) before it sends the message;
- trainer -> worker ``{"op": "ready", "c": chunk, "e": k}`` once the copies were
  enqueued and ready event ``k = chunk % packed_num_buffers`` (the init info's event
  handles) recorded after them.

The fill stream waits on the buffer's free event on the device, the worker's stream
on the ready event: no host round trip on the data's path. Ready event ``k`` is
recorded again only after the "want" of chunk ``c + depth`` arrived, which the worker
sends after its wait on ``k`` for chunk ``c`` was enqueued, so no wait sees a later
record. Handles are opened once per session (cached by id; the worker never reuses an
id); with release-after-round the trainer closes every mapping after the round and
says "unmapped" (after a round of at least one chunk: the worker reads it at its last),
and only then does the worker free its pool.

Every host wait is bounded by the transfer timeout; a dead worker is ``PeerLost``
(its channel end closed). On close, mappings are closed only after the fill stream
settled: a mapping that a copy may still write through is left open (leaked), never
closed under it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from weightwire._trace import trace
from weightwire.backends.base import Prepared, Sent
from weightwire.backends.ipc.channel import check_int
from weightwire.backends.ipc.gather import GatherCopy
from weightwire.backends.ipc.info import IPC_HANDLE_BYTES
from weightwire.backends.ipc.pipeline import IPCDataPath, _Starter
from weightwire.backends.ipc.slots import (
    close_mappings,
    destroy_events,
    open_event,
    open_mapping,
    record,
    stream_wait,
    wait_event_host,
)
from weightwire.shared.errors import TransferError
from weightwire.shared.framing import Chunk
from weightwire.shared.info import decode_secret
from weightwire.shared.meta import ParamMeta

MAX_BUFFERS = 1 << 16
"""Buffers one worker may name in a session (a bound on what the trainer maps for it)."""


class _Closes(Protocol):
    def close(self) -> None: ...


class WorkerBuffers:
    """One worker's receive buffers as this trainer mapped them.

    Keyed by buffer id: id -> (pointer, bytes, free event).
    """

    def __init__(self, cp: Any, device: int, peer: str) -> None:
        self._cp, self.device, self.peer = cp, int(device), peer
        self.mapped: dict[int, tuple[int, int, int]] = {}

    def resolve(self, msg: dict[str, Any], chunk_bytes: int) -> tuple[int, int]:
        """``(pointer, free event)`` of the buffer a "want" names, opened on first sight."""
        bid = check_int(msg, "b", 0, 1 << 62, self.peer)
        n = check_int(msg, "n", 1, 1 << 62, self.peer)
        if n != chunk_bytes:
            raise TransferError(
                f"{self.peer} wants {n} bytes for chunk {msg.get('c')} "
                f"where the plan has {chunk_bytes}: "
                "trainer and worker disagree on the round's plan"
            )
        known = self.mapped.get(bid)
        if known is not None:
            if "h" in msg or "f" in msg or "cap" in msg:
                raise TransferError(
                    f"{self.peer} announced buffer {bid} again (ids are never reused in a session)"
                )
            if known[1] < n:  # a copy past the end would write into whatever follows it
                raise TransferError(
                    f"{self.peer} named buffer {bid} of {known[1]} bytes for a chunk of {n}"
                )
            return known[0], known[2]
        if len(self.mapped) >= MAX_BUFFERS:
            raise TransferError(
                f"{self.peer} named more than {MAX_BUFFERS} receive buffers in one session"
            )
        if "h" not in msg or "f" not in msg or "cap" not in msg:
            raise TransferError(
                f"{self.peer} named buffer {bid} without its handles (first use in this session)"
            )
        cap = check_int(msg, "cap", n, 1 << 62, self.peer)
        try:
            mem = decode_secret(f"{self.peer} want.h", msg["h"], IPC_HANDLE_BYTES)
            ev = decode_secret(f"{self.peer} want.f", msg["f"], IPC_HANDLE_BYTES)
        except (
            ValueError
        ) as exc:  # a malformed message of the peer's: a protocol error, not a config one
            raise TransferError(str(exc)) from None
        with self._cp.cuda.Device(self.device):
            ptr = open_mapping(
                self._cp,
                mem,
                f"{self.peer}'s receive buffer {bid}",
                "; the worker must run on this host and its GPU be reachable from this one",
            )
            try:
                event = open_event(self._cp, ev, f"{self.peer}'s free event of buffer {bid}")
            except BaseException:
                close_mappings(self._cp, [ptr])
                raise
        self.mapped[bid] = (ptr, cap, event)
        return ptr, event

    def close(self) -> None:
        mapped, self.mapped = self.mapped, {}
        with self._cp.cuda.Device(self.device):
            close_mappings(self._cp, [ptr for ptr, _, _ in mapped.values()])
            destroy_events(self._cp, [event for _, _, event in mapped.values()])


def _early_wants(msg: dict[str, Any], depth: int, peer: str) -> dict[int, dict[str, Any]]:
    """An "early" message's wants by chunk, each checked like a want (``c`` below the
    depth: only the first chunks are named early, ``n`` a byte count)."""
    wants = msg.get("wants")
    if (
        not isinstance(wants, list)
        or not 0 < len(wants) <= depth
        or not all(isinstance(w, dict) for w in wants)
    ):
        raise TransferError(f"{peer} sent an 'early' message without 1..{depth} wants")
    out: dict[int, dict[str, Any]] = {}
    for want in wants:
        c = check_int(want, "c", 0, depth - 1, peer)
        check_int(want, "n", 1, 1 << 62, peer)
        if c in out:
            raise TransferError(f"{peer} named chunk {c} twice in one 'early' message")
        out[c] = {**want, "op": "want", "early": True}
    return out


@dataclass(frozen=True)
class ChunkFill:
    """One chunk's way into the workers' memory: its index in the round, its plan and device
    regions, the deadline and liveness check of every wait on it, and the round's starter
    (what must wait for the control plane)."""

    ci: int
    chunk: Chunk
    regions: list[Any]
    deadline: float
    alive: Callable[[], None]
    starter: _Starter


class IPCPullPipeline(IPCDataPath):
    """Chunks straight into the workers' buffers.

    Packed rounds only: the rendezvous picks pull only for them.
    """

    def _setup(self) -> None:
        comm = self._comm
        self._depth = len(comm.slots.events)
        self._buffers = [WorkerBuffers(comm.cp, comm.slots.device, ch.peer) for ch in comm.channels]
        self._gather = GatherCopy(comm.cp, comm.slots.device, self._sptr)
        self._gather.warm(comm.slots.nbytes)  # at the join, not beside a first round's step
        self._last_ready = -1  # the ready event of the round's last chunk (-1: none yet)
        self._metas: Sequence[ParamMeta] = ()  # the round's tensors in wire order
        self._early: list[dict[int, dict[str, Any]] | None] = [None] * len(comm.channels)
        """Per worker: this round's early wants by chunk.

        None until its "early" message was read.
        """

    def _prepare(self, metas: Sequence[ParamMeta]) -> None:
        # Before this round's start can reach a worker, an early message already here is
        # from an earlier round that read none of it (its buffers were never filled) and void.
        for ch in self._comm.channels:
            ch.discard_delivered("early")
        self._early = [None] * len(self._comm.channels)
        self._last_ready = -1
        self._metas = metas

    def _want(self, w: int, ci: int, nbytes: int, deadline: float, alive: Any) -> dict[str, Any]:
        """Worker ``w``'s want for chunk ``ci``: its early one when that was named for
        ``nbytes`` (the worker applies the same rule), else the want it sends for it."""
        ch = self._comm.channels[w]
        what = f"the receive buffer of chunk {ci}"
        early = self._early[w]
        if (
            early is None
        ):  # the round's first message: its early wants, if any, come before any want
            msg = ch.recv(deadline=deadline, what=what, alive=alive)
            if msg["op"] == "want":
                self._early[w] = {}
                return msg
            if msg["op"] != "early":
                raise TransferError(
                    f"{ch.peer} sent {msg['op']!r} where {what} ('want') was due: "
                    "the two sides disagree on the round"
                )
            early = self._early[w] = _early_wants(msg, self._depth, ch.peer)
            trace(f"early {sorted(early)}")
        named = early.pop(ci, None)
        if named is not None and named["n"] == nbytes:
            return named
        return ch.expect("want", deadline=deadline, what=what, alive=alive)

    def _pump(self, prepared: Iterable[Prepared], stop: threading.Event, starter: _Starter) -> Sent:
        comm, cp = self._comm, self._comm.cp
        nbytes = count = 0

        def alive() -> None:
            comm.alive()
            starter.check()

        with cp.cuda.Device(comm.slots.device):
            for ci, chunk, regions in self._chunks(prepared, stop):
                trace(f"regions {ci}")
                count += 1
                if not chunk.nbytes:  # nothing to write: the worker names no buffer for it either
                    continue
                deadline = time.monotonic() + self._timeout
                self._fill(ChunkFill(ci, chunk, regions, deadline, alive, starter))
                nbytes += chunk.nbytes
            starter.wait()
            if self._end_round():
                self._sync_fill("the IPC fill stream at the end of the round")
                self._in_flight[0].clear()
            if comm.release_after_round and count:
                # A round of no tensors has no chunk, so its workers never reach the tail
                # that reads "unmapped" (``IPCPullLink._round_tail``, at the last chunk): one
                # sent anyway would wait unread and fail their next round's first "ready".
                # Nothing was mapped in it either (the last round's mappings are closed).
                self._unmap()
        self.rounds += 1
        return Sent(nbytes, count)

    def _pulling(self) -> list[int]:
        """The workers this round's chunks go to through their receive buffers."""
        return list(range(len(self._comm.channels)))

    def _fill(self, f: ChunkFill) -> None:
        """Chunk ``f.ci`` into every pulling worker's buffer, then its ready message."""
        self._fill_others(f)
        ci, chunk, regions, deadline, alive = f.ci, f.chunk, f.regions, f.deadline, f.alive
        comm, cp = self._comm, self._comm.cp
        pulling = self._pulling()
        if not pulling:
            return
        for w in pulling:
            ch, bufs = comm.channels[w], self._buffers[w]
            msg = self._want(w, ci, chunk.nbytes, deadline, alive)
            trace(f"want {ci}{' early' if 'early' in msg else ''}")
            if check_int(msg, "c", 0, 1 << 62, ch.peer) != ci:
                raise TransferError(
                    f"{ch.peer} asked for chunk {msg['c']} where chunk {ci} was due: "
                    "trainer and worker disagree on the round's plan"
                )
            ptr, free = bufs.resolve(msg, chunk.nbytes)
            if self._host_wait:
                wait_event_host(
                    cp,
                    free,
                    deadline=deadline,
                    what=f"{ch.peer}'s release of buffer {msg['b']}",
                    alive=alive,
                )
            else:
                stream_wait(cp, self._sptr, free)
            self._gather.copy(ptr, regions, deadline=deadline, alive=alive)
        k = ci % self._depth
        record(cp, comm.slots.events[k], self._sptr)
        self._last_ready = k
        trace(f"filled {ci}")
        f.starter.wait()  # start + update POST: nothing is announced before they returned
        ready = {"op": "ready", "c": ci, "e": k}
        for w in pulling:
            comm.channels[w].send(ready)

    def _fill_others(self, f: ChunkFill) -> None:
        """Before the pulling workers' copies: a chunk's way to the workers that do not pull
        (``_pulling`` is read after it); ``f.starter`` holds what must wait for the control
        plane."""

    def _end_round(self) -> bool:
        """Every chunk was enqueued and announced; True: settle the fill stream now (else the
        round's regions stay held until a later ``send``, ``settle`` or ``close`` settles it)."""
        return True

    def _unmap(self) -> None:
        """Release-after-round: close every mapping (the fill stream settled), then let
        the workers free their buffers."""
        for bufs in self._buffers:
            bufs.close()
        for w in self._pulling():
            self._comm.channels[w].send({"op": "unmapped"})

    def close(self) -> None:
        try:
            self._close_settled(self._gather, self._buffers)
        finally:
            self._buffers = []
            self._in_flight = [[]]
            self._comm.release()

    def _close_settled(self, copier: _Closes, mappings: Sequence[_Closes]) -> None:
        """Close ``copier`` (no upload reads its tables any more) and ``mappings`` once the
        fill stream settled; while a copy may still write through the mappings, both stay
        open. A failure on the way still closes the mappings."""
        still_copying = False
        try:
            if self._settled_quietly():
                copier.close()
            else:
                still_copying = True
        finally:
            if not still_copying:
                for mapping in mappings:
                    mapping.close()

    def held_bytes(self) -> int:
        """Trainer-side extra device memory: none (the chunks land in the workers' buffers)."""
        return self._comm.slots.held_bytes()
