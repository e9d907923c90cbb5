"""``IPCWriteThroughPipeline``: rank 0 writes each tensor straight into the workers' serving
parameters (``weightwire_ipc`` write-through; one device copy per byte, no receive buffer).

Per worker and round, the worker's first message says how the round reaches it:

- ``land`` (its first round with these tensors): its landing table (``table``), or
  ``refused`` with the reason (its loader is not a plain copy). The trainer checks the
  table, maps each allocation once per session (``cudaIpcOpenMemHandle``), plans the
  copies and answers ``{"op": "path", "t": id, "wt": true}``, or ``false`` with ``why``
  when it cannot (a kernel that does not compile, a handle that does not open);
- ``go`` (``t``: an accepted table's id): write. The worker sends it after it recorded
  the round as written in place, with its free event recorded on the stream its model
  runs on; the fill stream waits on that event before the first write;
- ``want`` (a refused or declined table): that worker's round goes through its receive
  buffers (``ipc.pull``), and only it: each worker has its own path.

Per chunk the copies into a worker are one gather launch (contiguous runs, cached device
tables: a torch trainer's rounds reuse them) plus one strided / casting launch per dtype
pair for the landings that are neither (``kernels``: a table of the chunk's landings);
each chunk's runs are kept as arrays (``_ChunkCopies``: a round adds its tensors' pointers).
When the first write may go (the failure rule):

- one server whose start pauses before its workers' start (``Outgoing.go_accepts``), and
  every worker's go came from inside its start (``early``): the gos are the round's
  acceptance (each worker sends its go as the last step of its start, once the round is
  recorded as written in place), so the first chunk is written at the go, beside the
  start's answer. A start that fails after that (a replica's reply lost, the server's
  answer lost) fails the round as one failed after its first byte: each worker's round was
  recorded as written in place from its start, so an aborted one leaves its model marked
  incomplete and generation refused until a whole round commits; the trainer reports the
  round failed and its engine broken (``trainer.transfer``: ``wrote_early``);
- otherwise (several servers, where a go sent from inside one server's start does not say
  another accepted; a stock start; a worker whose go comes with its update) nothing is
  written before the round's ``begin`` returned (the start answered: the round accepted
  and paused on every server).

Either way the first chunk's copies are staged while the start is out (planned, their
tables built and uploaded), so the acceptance is followed by launches only.
After the last chunk: ``{"op": "done", "e": k}`` once ready event ``k`` was recorded
behind every copy; the worker's stream waits on it.
Generation stays refused around every round (``RoundSender.in_place``): a worker's
weights are not whole from the first write until the round commits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from weightwire._trace import trace
from weightwire.backends.device import StreamRef
from weightwire.backends.ipc.channel import check_int
from weightwire.backends.ipc.gather import GatherCopy, StagedRows
from weightwire.backends.ipc.pull import ChunkFill, IPCPullPipeline
from weightwire.backends.ipc.slots import (
    close_mappings,
    event_query,
    open_mapping,
    record,
    stream_wait,
    wait_event_host,
)
from weightwire.backends.ipc.through.kernels import Launch, StagedLaunches, StridedCopy
from weightwire.backends.ipc.through.table import LandingTable, plan_copies, read_table
from weightwire.shared.errors import TransferError
from weightwire.shared.framing import Chunk
from weightwire.shared.meta import ParamMeta

log = logging.getLogger(__name__)

_RING = 32
"""Gather tables kept on the device: a round of up to this many chunks reuses every one."""


@dataclass(frozen=True)
class _ChunkCopies:
    """One chunk's copies into one worker, by array: per contiguous run its tensor (index
    in the chunk), source offset in that tensor, destination pointer and bytes; its strided
    launches as ``(launch, tensor index in the chunk, allocation pointer)``."""

    tensor: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    strided: list[tuple[Launch, int, int]]


@dataclass(frozen=True)
class _Landed:
    """A worker's accepted table, planned: per tensor its runs (source offset, destination
    pointer, bytes) and its strided launches (with their allocation's pointer)."""

    tid: int
    metas: tuple[ParamMeta, ...]
    wire: Any
    """The round's metadata list it was planned for (the same object every round of a plan)."""
    runs: list[list[tuple[int, int, int]]]
    strided: list[list[tuple[Launch, int]]]
    chunks: dict[tuple[int, int], _ChunkCopies] = field(default_factory=dict)
    """Per chunk (its tensors' range), its copies as arrays: built on its first round."""

    def of_chunk(self, chunk: Chunk) -> _ChunkCopies:
        """Chunk ``chunk``'s copies (built once: every round of a plan cuts the same chunks)."""
        key = (chunk.start, chunk.stop)
        known = self.chunks.get(key)
        if known is not None:
            return known
        tensor, src, dst, nbytes = [], [], [], []
        strided: list[tuple[Launch, int, int]] = []
        for k, i in enumerate(range(chunk.start, chunk.stop)):
            for s, d, n in self.runs[i]:
                tensor.append(k)
                src.append(s)
                dst.append(d)
                nbytes.append(n)
            strided.extend((launch, k, alloc) for launch, alloc in self.strided[i])
        made = self.chunks[key] = _ChunkCopies(
            np.array(tensor, dtype=np.int64),
            np.array(src, dtype=np.uint64),
            np.array(dst, dtype=np.uint64),
            np.array(nbytes, dtype=np.int64),
            strided,
        )
        return made


@dataclass
class _Staged:
    """One chunk's copies into one worker, staged (``_stage``): launched by ``_launch``."""

    landed: _Landed
    rows: StagedRows
    strided: StagedLaunches


class _Mappings:
    """One worker's allocations as this trainer mapped them (once per session each)."""

    def __init__(self, cp: Any, device: int, peer: str) -> None:
        self._cp, self.device, self.peer = cp, int(device), peer
        self.mapped: dict[bytes, int] = {}

    def open(self, handle: bytes) -> int:
        known = self.mapped.get(handle)
        if known is not None:
            return known
        with self._cp.cuda.Device(self.device):
            ptr = open_mapping(self._cp, handle, f"{self.peer}'s parameter memory")
        self.mapped[handle] = ptr
        return ptr

    def close(self) -> None:
        mapped, self.mapped = self.mapped, {}
        with self._cp.cuda.Device(self.device):
            close_mappings(self._cp, mapped.values())


class _Copiers:
    """The gather and strided copiers, closed together once the fill stream settled."""

    def __init__(self, *copiers: Any) -> None:
        self._copiers = copiers

    def close(self) -> None:
        for copier in self._copiers:
            copier.close()


class IPCWriteThroughPipeline(IPCPullPipeline):
    """Rounds written into the workers' parameters (see the module docstring)."""

    in_place = True
    hears_workers = True  # every worker's first message is read before any write

    def _setup(self) -> None:
        super()._setup()
        comm = self._comm
        n, cp, device = len(comm.channels), comm.cp, comm.slots.device
        self._landed: list[_Landed | None] = [None] * n
        self._maps = [_Mappings(cp, device, ch.peer) for ch in comm.channels]
        self._through = [False] * n
        self._early_go = [False] * n  # per worker: this round's go came from inside its start
        self._known = False  # this round's paths are known
        self._runs = GatherCopy(cp, device, self._sptr, ring=_RING)
        self._runs.warm(comm.slots.nbytes)
        self._strided = StridedCopy(cp, device, self._sptr)
        self._stream_ref = StreamRef(self._sptr)
        self._told: set[str] = set()
        self._tail: int | None = None
        """The event recorded behind the last round's copies, while they are unsettled."""
        self._unsettled: BaseException | None = None
        """Why those copies did not settle: a later ``settle`` fails with it, not waiting again."""

    def _prepare(self, metas: Sequence[ParamMeta]) -> None:
        if self._in_flight[0]:
            self._settle_last()
        for ch in self._comm.channels:  # a go of a round that sent no byte: void
            ch.discard_delivered("go")
        self._through = [False] * len(self._comm.channels)
        self._early_go = [False] * len(self._comm.channels)
        self._known = False
        super()._prepare(metas)

    def _settle_last(self) -> None:
        """The last round's copies, written through to every worker and never waited for
        here (each worker's commit waits for them): settled before this round's start can
        go, so a failure of theirs (a device error, copies that never end) fails this round
        before any server opened it (its workers would refuse generation until a whole
        round commits). Long done in the common case: one query of the event recorded
        behind them, no wait."""
        try:
            tail, self._tail = self._tail, None
            if tail is not None and event_query(self._comm.cp, tail):
                self._in_flight[0].clear()
                return
            self.settle()
        except BaseException as exc:
            exc.add_note(
                "the previous round's copies into the workers' parameters did not settle on "
                "the trainer's device: this round sent nothing (no start)"
            )
            self._unsettled = exc
            raise

    def settle(self) -> None:
        if self._unsettled is not None:  # copies that never ended: one bounded wait was enough
            raise self._unsettled
        super().settle()

    def _pulling(self) -> list[int]:
        return [w for w, through in enumerate(self._through) if not through]

    def _fill_others(self, f: ChunkFill) -> None:
        """The workers written through: the round's paths first (they decide who pulls).

        Nothing is written into a worker's parameters before the round is accepted (the
        module docstring: every worker's go from inside its start where that is the
        acceptance, else ``begin`` returned). Everything else of the first chunk runs while
        the start is out: its copies are staged (plan, tables built and uploaded) for each
        worker whose table holds, before its go is even read."""
        if self._known:
            for w, through in enumerate(self._through):
                if through:
                    self._launch(self._stage(w, f), f)
            return
        staged: dict[int, _Staged] = {}
        early = False
        try:
            for w, landed in enumerate(self._landed):
                if landed is not None and self._planned_for(landed):
                    staged[w] = self._stage(w, f)
            self._paths(f.deadline, f.alive)
            f.starter.heard_all()
            for w, through in enumerate(self._through):
                known = staged.get(w)
                if known is not None and (not through or known.landed is not self._landed[w]):
                    self._discard(staged.pop(w))  # its table changed, or it pulls this round
                if through and w not in staged:
                    staged[w] = self._stage(w, f)
            if staged:
                early = f.starter.before_write(all(self._early_go))
        except BaseException:
            for st in staged.values():
                self._discard(st)
            raise
        trace("wt go accepted" if early else "wt start answered")
        todo = list(staged.values())  # in the order staged: a ring slot is reused in that order
        for n, st in enumerate(todo):
            try:
                self._launch(st, f)
            except BaseException:
                for rest in todo[n + 1 :]:  # a slot held past this round stalls its ring
                    self._discard(rest)
                raise

    def _end_round(self) -> bool:
        writing = [w for w, through in enumerate(self._through) if through]
        if not writing:
            return True
        e = self._last_ready  # a pulling worker's last ready event follows every copy too
        if e < 0:
            e = 0
            record(self._comm.cp, self._comm.slots.events[0], self._sptr)
        trace("wt enqueued")
        self._tail = self._comm.slots.events[e]  # queried before the next round's start
        for w in writing:
            self._comm.channels[w].send({"op": "done", "e": e})
        # Written through to every worker: each one's commit waits for this round's ready
        # event before it returns, so the copies are done once the round committed, and the
        # fill stream need not be waited for here (the regions stay held until it is).
        return bool(self._pulling()) or self._comm.release_after_round

    # -- the round's paths ------------------------------------------------------------------

    def _paths(self, deadline: float, alive: Callable[[], None]) -> None:
        comm = self._comm
        for w in range(len(comm.channels)):
            self._through[w] = self._path(w, deadline, alive)
        self._known = True
        trace("wt paths")
        for w, through in enumerate(self._through):
            if not through:
                continue
            free = comm.free_events[w][0]
            if self._host_wait:
                wait_event_host(
                    comm.cp,
                    free,
                    deadline=deadline,
                    what=f"{comm.channels[w].peer}'s model work before the round",
                    alive=alive,
                )
            else:
                stream_wait(comm.cp, self._sptr, free)

    def _path(self, w: int, deadline: float, alive: Callable[[], None]) -> bool:
        """Whether worker ``w`` is written through this round (its first message)."""
        ch = self._comm.channels[w]
        what = "the worker's first message of the round"
        msg = ch.recv(deadline=deadline, what=what, alive=alive)
        if msg["op"] == "go" and msg.get("early") is True and not self._holds(w, msg):
            # sent at its start for the last table: this round's tensors differ, and the
            # worker sends their table with the update
            msg = ch.recv(deadline=deadline, what=what, alive=alive)
        if msg["op"] == "land":
            if self._table(w, msg, deadline, alive):
                msg = ch.expect("go", deadline=deadline, what="the worker's go", alive=alive)
            else:
                msg = ch.recv(deadline=deadline, what=what, alive=alive)
        if msg["op"] == "go":
            if not self._holds(w, msg):
                raise TransferError(
                    f"{ch.peer} asked to be written through with table {msg.get('t')!r}, which "
                    "this trainer did not accept for this round's tensors"
                )
            self._early_go[w] = msg.get("early") is True
            return True
        ch.unread(msg)  # its round goes through its receive buffers: the pull path reads it
        return False

    def _holds(self, w: int, go: dict[str, Any]) -> bool:
        """Whether worker ``w``'s accepted table is the one ``go`` names, for this round."""
        landed = self._landed[w]
        return landed is not None and go.get("t") == landed.tid and self._planned_for(landed)

    def _planned_for(self, landed: _Landed) -> bool:
        """Whether ``landed`` was planned for this round's tensors."""
        return landed.wire is self._metas or landed.metas == tuple(self._metas)

    def _table(self, w: int, head: dict[str, Any], deadline: float, alive: Any) -> bool:
        """Read worker ``w``'s ``land`` message; True when its table was accepted."""
        ch = self._comm.channels[w]
        tid = check_int(head, "t", 0, 1 << 62, ch.peer)
        self._landed[w] = None
        if "refused" in head:
            self._tell(f"{ch.peer} is not written through: {str(head['refused'])[:500]}")
            return False
        table = read_table(
            head,
            lambda: ch.expect("land_part", deadline=deadline, what="the table's part", alive=alive),
            self._metas,
            ch.peer,
        )
        try:
            landed = self._plan(w, tid, table)
        except TransferError as exc:
            ch.send({"op": "path", "t": tid, "wt": False, "why": str(exc)[:2000]})
            self._tell(f"{ch.peer} is not written through: {exc}")
            return False
        ch.send({"op": "path", "t": tid, "wt": True})
        self._landed[w] = landed
        return True

    def _tell(self, why: str) -> None:
        """Say once per session why a worker's rounds go through its receive buffers."""
        if why not in self._told:
            self._told.add(why)
            log.warning("weightwire_ipc: %s; its rounds land in its receive buffers (pull)", why)

    def _plan(self, w: int, tid: int, table: LandingTable) -> _Landed:
        comm = self._comm
        with comm.cp.cuda.Device(comm.slots.device):
            ptrs = [self._maps[w].open(a.handle) for a in table.allocs]
            runs, strided = [], []
            for copies in plan_copies(table, self._metas):
                runs.append([(r.src, ptrs[r.alloc] + r.dst, r.nbytes) for r in copies.runs])
                strided.append([(self._strided.prepare(j), ptrs[j.alloc]) for j in copies.strided])
        return _Landed(tid, tuple(self._metas), self._metas, runs, strided)

    # -- the copies -------------------------------------------------------------------------

    def _stage(self, w: int, f: ChunkFill) -> _Staged:
        """Chunk ``f``'s copies into worker ``w``, planned and their tables uploaded (nothing
        written into its parameters)."""
        landed = self._landed[w]
        assert landed is not None
        copies = landed.of_chunk(f.chunk)
        regions = f.regions
        bases = np.fromiter((r.ptr for r in regions), dtype=np.uint64, count=len(regions))
        srcs = bases[copies.tensor] + copies.src
        rows = self._runs.stage(srcs, copies.dst, copies.nbytes, deadline=f.deadline, alive=f.alive)
        try:
            strided = self._strided.stage_all(
                [(launch, regions[k].ptr, alloc) for launch, k, alloc in copies.strided],
                deadline=f.deadline,
                alive=f.alive,
            )
        except BaseException:
            self._runs.discard(rows)
            raise
        return _Staged(landed, rows, strided)

    def _launch(self, st: _Staged, f: ChunkFill) -> None:
        """Enqueue ``st``'s writes (the strided launches, then the runs); its ring slots are
        released whatever happens."""
        try:
            self._strided.launch_staged(st.strided, self._stream_ref)
        except BaseException:
            self._runs.discard(st.rows)
            raise
        try:
            self._runs.launch(st.rows, deadline=f.deadline, alive=f.alive)
        finally:
            self._runs.discard(st.rows)

    def _discard(self, st: _Staged) -> None:
        self._strided.discard(st.strided)
        self._runs.discard(st.rows)

    def close(self) -> None:
        try:
            self._close_settled(_Copiers(self._runs, self._strided), self._maps)
        finally:
            self._maps = []
            super().close()
