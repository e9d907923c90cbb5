"""``IPCPipeline``: rank 0's push data path for ``weightwire_ipc`` (the slot ring), and
``IPCDataPath``, the part it shares with the pull path (``backends.ipc.pull``).

A round is the plan's chunks (packed or unpacked framing, as for NCCL); each chunk
goes through the ring of IPC slots as *pieces* of at most one slot. The framework's
``DevicePacker`` only resolves every tensor to its device bytes (zero-copy, ordered
before the fill stream); the bytes are then copied straight into the slot with one
``cudaMemcpyAsync`` per tensor (or tensor part, where a tensor crosses a slot edge):
one device copy on this side, one (the copy-out) on each worker.

Ordering is on the device: before refilling slot ``s`` the fill stream waits on every
worker's free event for ``s`` (the worker records it after its copy-out); after a
piece the fill stream records the slot's ready event and only then is the "ready"
message sent. The host waits only for the "free" *message* of a slot it is about to
reuse (the worker sends it as soon as its copy-out is enqueued), bounded by the
transfer timeout, and once per round for the fill stream.
"""

from __future__ import annotations

import itertools
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, wait
from typing import Any

from weightwire._trace import dump_trace, trace
from weightwire.backends.base import (
    Begin,
    DevicePacker,
    Outgoing,
    Prepared,
    RoundAborted,
    RoundSender,
    Sent,
    check_chunk_bytes,
)
from weightwire.backends.device import stream_pointer
from weightwire.backends.ipc.channel import check_int
from weightwire.backends.ipc.link import IPCSenderComm
from weightwire.backends.ipc.slots import (
    MEMCPY_DEVICE_TO_DEVICE,
    record,
    stream_wait,
    sync_stream,
    wait_event_host,
    wait_mode,
)
from weightwire.control.fanout import spawn
from weightwire.shared.errors import TransferError, TransferTimeout
from weightwire.shared.framing import Chunk
from weightwire.shared.meta import ParamMeta


class IPCDataPath(RoundSender):
    """What both IPC data paths (push: ``IPCPipeline``; pull: ``ipc.pull.IPCPullPipeline``)
    share: one fill stream, the control plane on a side thread beside the first fills,
    each chunk's device regions checked against the plan and held until the fill stream
    settled."""

    def __init__(self, comm: IPCSenderComm, packer: DevicePacker, *, timeout: float) -> None:
        # The slots set the ring's depth; a round's regions are held until its fill stream
        # settled (no buffer count or hold bound, unlike ``pipelines.DevicePipeline``).
        self._comm = comm
        self._packer = packer
        self._timeout = timeout
        self._stream = packer.new_stream()
        self._sptr = stream_pointer(self._stream)
        self._in_flight: list[list[Any]] = [[]]
        self._host_wait = wait_mode() == "host"
        self.rounds = 0
        self._setup()

    def _setup(self) -> None:
        """A data path's own state, once ``IPCDataPath``'s is set."""

    # out.root: IPC carries one broadcaster (check_receiver refuses several), always rank 0.
    def send(self, out: Outgoing) -> Sent:
        """``_pump`` a round with the control plane (pause, start, then the update POST)
        running beside the first fills; the pump announces nothing before it returned.
        Joined on every exit path."""
        self._prepare(out.metas)
        trace("round")
        # The first chunk is made (its tensors read from the source) before the start may go:
        # a source that fails on its first tensors lets no start out, so no server opens a
        # round that gets no byte (a worker written through from its start would refuse
        # generation until a whole round commits). Its staging comes after the release.
        chunks = iter(out.prepared)
        first = list(itertools.islice(chunks, 1))
        if out.ready is not None:  # the start goes now, before the first chunk's work
            out.ready()
            trace("start released")
        if out.request is not None:  # the round's one request, likewise
            out.request()
        starter = _Starter(
            out.begin,
            timeout=_CONTROL_BOUND_S + self._timeout,
            go_accepts=out.go_accepts or out.one_request,
            wrote_early=out.wrote_early,
            heard=out.heard if out.one_request else None,
        )
        try:
            return self._pump(itertools.chain(first, chunks), out.stop, starter)
        finally:
            starter.join()
            trace("end")
            dump_trace("trainer")

    def _prepare(self, metas: Sequence[ParamMeta]) -> None:
        """Before the round's control plane starts (``metas``: its tensors in wire order):
        no start can have gone out yet (``trainer.round.announced`` lets it go once the
        first chunk was made)."""

    @abstractmethod
    def _pump(self, prepared: Iterable[Prepared], stop: threading.Event, starter: _Starter) -> Sent:
        """The round's chunks through this data path."""

    def _chunks(
        self, prepared: Iterable[Prepared], stop: threading.Event
    ) -> Iterator[tuple[int, Chunk, list[Any]]]:
        """Each chunk's index, the chunk and its device regions, checked against the plan and
        held until the fill stream settled; ``RoundAborted`` once ``stop`` is set."""
        for ci, (chunk, tensors) in enumerate(prepared):
            if stop.is_set():
                raise RoundAborted("round stopped between chunks")
            self._comm.alive()
            regions = self._packer.regions(tensors, self._stream)
            check_chunk_bytes(chunk, sum(r.nbytes for r in regions))
            self._in_flight[0].append(regions)
            yield ci, chunk, regions

    def _sync_fill(self, what: str) -> None:
        comm = self._comm
        sync_stream(
            comm.cp,
            comm.slots.device,
            self._sptr,
            timeout=self._timeout,
            what=what,
            alive=comm.alive,
        )

    def settle(self) -> None:
        self._sync_fill("the IPC fill stream")
        self._in_flight[0].clear()

    def _settled_quietly(self) -> bool:
        """On close: whether the fill stream settled (bounded); False: a copy may still run,
        so nothing it reads or writes may be freed or unmapped."""
        comm = self._comm
        try:
            sync_stream(
                comm.cp,
                comm.slots.device,
                self._sptr,
                timeout=min(self._timeout, 30.0),
                what="the fill stream",
            )
        except Exception:
            return False
        return True


class IPCPipeline(IPCDataPath):
    """Pieces through the slot ring. Packed or unpacked, a chunk goes through the ring as
    pieces."""

    def _setup(self) -> None:
        self._pending = [False] * self._comm.slots.count  # slot written, its free not yet seen
        self._next = 0
        self._remap = False  # release-after-round: new handles to announce before the next piece

    # -- the RoundSender surface --------------------------------------------------------------

    def close(self) -> None:
        try:
            # A fill stream that will not settle: leak the slots rather than free memory under
            # a copy.
            if self._comm.slots.allocated and not self._settled_quietly():
                self._comm.slots.ptrs = []
        finally:
            self._in_flight = [[]]
            self._comm.release()

    def held_bytes(self) -> int:
        """Trainer-side extra device memory: the slots.

        0 between rounds with release-after-round.
        """
        return self._comm.slots.held_bytes()

    # -- a round ----------------------------------------------------------------------------

    def _prepare(self, metas: Sequence[ParamMeta]) -> None:
        slots = self._comm.slots
        if not slots.allocated:
            slots.allocate()
            self._remap = True

    def _pump(self, prepared: Iterable[Prepared], stop: threading.Event, starter: _Starter) -> Sent:
        # The slots are this side's own memory: filling them may start before start returned.
        comm, slots, cp = self._comm, self._comm.slots, self._comm.cp
        copy = cp.cuda.runtime.memcpyAsync
        size, n = slots.nbytes, slots.count
        nbytes = pieces = chunks = 0

        def flush(ci: int, slot: int, offset: int, fill: int) -> None:
            record(cp, slots.events[slot], self._sptr)
            trace(f"filled {slot}")
            starter.wait()  # start + update POST: nothing is announced before them
            if self._remap:
                self._announce_slots()
            msg = {"op": "ready", "c": ci, "s": slot, "o": offset, "n": fill}
            for ch in comm.channels:
                ch.send(msg)
            self._pending[slot] = True

        with cp.cuda.Device(slots.device):
            for ci, chunk, regions in self._chunks(prepared, stop):
                offset, slot, fill, base = 0, -1, 0, 0
                for region in regions:
                    done = 0
                    while done < region.nbytes:
                        if slot < 0:
                            slot = self._next
                            self._acquire(slot)
                            fill, base = 0, slots.ptrs[slot]
                        take = min(region.nbytes - done, size - fill)
                        copy(
                            base + fill,
                            region.ptr + done,
                            take,
                            MEMCPY_DEVICE_TO_DEVICE,
                            self._sptr,
                        )
                        fill, done = fill + take, done + take
                        if fill == size:
                            flush(ci, slot, offset, fill)
                            offset, slot, pieces = offset + fill, -1, pieces + 1
                            self._next = (self._next + 1) % n
                if slot >= 0:
                    flush(ci, slot, offset, fill)
                    pieces += 1
                    self._next = (self._next + 1) % n
                nbytes += chunk.nbytes
                chunks += 1
            starter.wait()
            self._end_round(closing=chunks > 0)
        self.rounds += 1
        return Sent(nbytes, pieces)

    def _acquire(self, slot: int) -> None:
        """Slot ``slot`` may be refilled: every worker's free message for it arrived and
        the fill stream waits (on the device) for their copy-outs."""
        if not self._pending[slot]:
            return
        comm = self._comm
        deadline = time.monotonic() + self._timeout
        for w, ch in enumerate(comm.channels):
            msg = ch.expect(
                "free", deadline=deadline, what=f"the release of IPC slot {slot}", alive=comm.alive
            )
            if check_int(msg, "s", 0, comm.slots.count - 1, ch.peer) != slot:
                raise TransferError(
                    f"{ch.peer} released IPC slot {msg['s']} where slot {slot} was due"
                )
            if self._host_wait:
                wait_event_host(
                    comm.cp,
                    comm.free_events[w][slot],
                    deadline=deadline,
                    what=f"{ch.peer}'s copy-out of IPC slot {slot}",
                    alive=comm.alive,
                )
            else:
                stream_wait(comm.cp, self._sptr, comm.free_events[w][slot])
        self._pending[slot] = False
        trace(f"acquired {slot}")

    def _end_round(self, *, closing: bool) -> None:
        """Collect the last releases, settle the fill stream (bounded), and with
        release-after-round free the slots once every worker closed its mappings.
        ``closing``: the round had a chunk, at whose end each worker says "closed"; a round
        of no tensors has none, so none says it (and none mapped the slots: they are
        announced with the first piece)."""
        comm = self._comm
        n = comm.slots.count
        for k in range(n):  # oldest piece first: releases arrive in ring order
            self._acquire((self._next + k) % n)
        self._sync_fill("the IPC fill stream at the end of the round")
        self._in_flight[0].clear()
        if comm.release_after_round:
            deadline = time.monotonic() + self._timeout
            for ch in comm.channels if closing else ():
                ch.expect(
                    "closed",
                    deadline=deadline,
                    what="the worker's close of its slot mappings",
                    alive=comm.alive,
                )
            comm.slots.free_memory()

    def _announce_slots(self) -> None:
        msg = {"op": "slots", "mem": self._comm.slots.mem_handles_b64()}
        for ch in self._comm.channels:
            ch.send(msg)
        self._remap = False


_CONTROL_BOUND_S = 2 * 300.0
"""Backstop for the control plane's thread: its calls are each bounded by the client's
own HTTP timeout (``Timeouts.http_s``, 300 s by default); this only guards a client that is not."""


class _Starter:
    """Runs the round's ``begin`` (control plane) on a helper thread from the start."""

    def __init__(
        self,
        begin: Begin,
        *,
        timeout: float,
        go_accepts: bool = False,
        wrote_early: threading.Event | None = None,
        heard: Callable[[], None] | None = None,
    ) -> None:
        """``heard``: the round is one request (``Outgoing.one_request``): told once every
        worker's first word was read, which is then the round's acceptance."""
        self._timeout = timeout
        self._go_accepts = go_accepts
        self._heard = heard
        self._wrote_early = threading.Event() if wrote_early is None else wrote_early
        self._error: BaseException | None = None
        self._done: Future[None] | None = None
        if begin is not None:
            self._done = spawn(lambda: self._run(begin), name="weightwire-ipc-begin")

    def _run(self, begin: Any) -> None:
        try:
            begin()
            trace("begun")
        except BaseException as exc:
            self._error = exc

    def join(self) -> None:
        if self._done is not None and not wait([self._done], timeout=self._timeout).done:
            raise TransferTimeout(
                f"the control plane (pause / start / update POST) did not return within "
                f"{self._timeout:g} s"
            )

    def check(self) -> None:
        """Re-raise ``begin``'s error if it already failed (pull mode waits for the workers'
        first message, which never comes when the start was refused)."""
        if self._error is not None:
            self.wait()

    def heard_all(self) -> None:
        """Every worker's first word of the round was read (each its go or its want). In a
        round of one request (``heard`` given) that accepts it: ``begin`` returns now."""
        if self._heard is not None:
            self._heard()

    def before_write(self, gone: bool) -> bool:
        """Before the round's first write into a worker's serving parameters. ``gone``: every
        worker said from inside its start that it is in the round; where that is the round's
        acceptance (``Outgoing.go_accepts``) the write goes now, beside the start's answer,
        and is recorded as early (True); else it waits for ``begin`` (its error raised here).
        In a round of one request every worker's go accepts it, from its update too."""
        gone = gone or self._heard is not None
        if gone and self._go_accepts and self._done is not None and not self._done.done():
            self._wrote_early.set()  # before the write: a begin failing from now on sees it
            return True
        self.wait()
        return False

    def wait(self) -> None:
        """Block until ``begin`` returned; re-raise its error here."""
        self.join()
        if self._error is not None:
            error, self._error = self._error, None
            self._done = None
            raise error
