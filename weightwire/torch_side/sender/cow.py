"""``snapshot="cow"``: an overlapped torch round that reads the live parameters, copying a
tensor only when the trainer is about to write it before the round has read it.

``send_weights(wait=False)`` records a reference to every tensor of the source and its
version counter (``tensor._version``, bumped by every in-place write through the tensor or a
view of it), on the trainer's thread, copying nothing. The round then reads the live tensors
in its own order. A write the snapshot sees coming is made safe first:

- every torch optimizer's ``step`` (a global step pre-hook, held while a ``cow`` round is
  in flight): each tensor of that optimizer's parameters the round has not read yet is
  copied first (one foreach copy on the trainer's current stream, ahead of the step's
  kernels, no host wait; the round's own stream waits for it, then sends the copy); if the
  round was already handed one of them, the step waits until the round's data plane has
  read everything (its ``before_commit``, which also waits for the round's own streams),
  bounded by the round's timeout;
- ``TorchTrainerEngine.before_update()``: the same for every tensor of the round, for a
  trainer that writes its parameters without a torch optimizer.

Any other in-place write is caught by the version counter: a tensor whose counter moved is
refused when the round reaches it, and every tensor read live is checked again right before
the round's finish, so the round raises ``SnapshotChanged`` naming the tensor and commits
nothing; it never sends a mix of two steps. Not caught: writes through ``param.data`` (a
tensor with a version counter of its own) or through a pointer torch does not see (a raw
kernel): with those, keep ``snapshot="copy"``.

Memory: the copies of the tensors an optimizer step reached before the round read them
(``CowStats``); zero when the round ends before the next step.
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from weightwire.shared.errors import WrongType
from weightwire.shared.meta import ParamMeta
from weightwire.shared.source import WeightSource
from weightwire.torch_side.sender.snapshot import (
    RoundStreams,
    copy_all,
    cuda_devices,
    device_wait,
    settle,
)
from weightwire.trainer.overlap import RoundWaitTimeout
from weightwire.trainer.snapshot import FrozenSource, Snapshot, SnapshotChanged

_PENDING, _LIVE, _COPIED = "pending", "live", "copied"


@dataclass
class CowStats:
    """The snapshots' own accounting (one engine, every round): bytes of copies held now, the
    most held at once, the total copied, and the seconds parameter writes waited for a round
    to finish reading what it was handed."""

    held: int = 0
    peak: int = 0
    copied: int = 0
    waited_s: float = 0.0

    def add(self, n: int) -> None:
        self.held += n
        self.copied += n
        self.peak = max(self.peak, self.held)


class _Entry:
    __slots__ = ("_storage", "copy", "event", "live", "name", "state", "version")

    def __init__(self, name: str, live: torch.Tensor) -> None:
        self.name, self.live = name, live
        self.version = live._version
        self._storage: int | None = None  # found when a write first asks (one after the
        # round ended never does: send_weights pays no storage lookup per tensor)
        self.state = _PENDING
        self.copy: torch.Tensor | None = None
        self.event: Any = None

    @property
    def storage(self) -> int:
        if self._storage is None:
            self._storage = self.live.untyped_storage().data_ptr()
        return self._storage


class CowRound:
    """One round's copy-on-write snapshot (see the module docstring)."""

    def __init__(
        self, entries: list[_Entry], stats: CowStats, wait_s: float, devices: list[int]
    ) -> None:
        self._entries = entries
        self._stats = stats
        self._wait_s = wait_s
        self._cond = threading.Condition()
        self._done = False  # the round's data plane read everything, or the round ended
        self._held = 0
        self._devices = devices
        self.ready = device_wait(devices)
        """On the round's thread before its first read: the trainer's queued work is done."""

    # -- the trainer's thread
    def protect(self, storages: set[int] | None) -> None:
        """Before a write of ``storages`` (None: every tensor): copy the tensors the round
        has not read yet; wait while the round may still be reading one it was handed."""
        with self._cond:
            if self._done:
                return
            hit = [e for e in self._entries if storages is None or e.storage in storages]
            # A counter already moved: the round refuses the tensor when it gets there (a copy
            # now would be of the new values).
            due = [e for e in hit if e.state == _PENDING and e.live._version == e.version]
            copies = [torch.empty_like(e.live) for e in due]
            copy_all(copies, [e.live for e in due])  # one foreach copy, not a clone each
            copied = 0
            for e, c in zip(due, copies, strict=True):
                e.copy, e.state = c, _COPIED
                copied += c.nbytes
            if copied:
                events: dict[torch.device, Any] = {}
                for e in hit:
                    if e.state == _COPIED and e.event is None and e.live.is_cuda:
                        e.event = events.get(e.live.device) or _stream_event(e.live.device)
                        events[e.live.device] = e.event
                self._held += copied
                self._stats.add(copied)
            start = time.monotonic()
            deadline = start + self._wait_s
            while not self._done and any(e.state == _LIVE for e in hit):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RoundWaitTimeout(
                        f"a parameter write waited {self._wait_s:.0f} s for an overlapped round "
                        "(snapshot='cow') to finish reading the tensors it was handed"
                    )
                self._cond.wait(left)
            self._stats.waited_s += time.monotonic() - start

    # -- the round's thread
    def pairs(self) -> list[tuple[str, Any]]:
        return [(e.name, _Read(self, e)) for e in self._entries]

    def read(self, e: _Entry) -> torch.Tensor:
        with self._cond:
            if e.state == _COPIED:
                assert e.copy is not None
                if e.event is not None:
                    torch.cuda.current_stream(e.copy.device).wait_event(e.event)
                return e.copy
            self._check(e)
            e.state = _LIVE
            return e.live

    def before_commit(self) -> None:
        """Every tensor read live still holds the snapshot's version (checked under the lock
        that the optimizer hook waits on: no step it guards has written one yet)."""
        with self._cond:
            try:
                # The round's device reads of the live tensors ran on its own streams
                # (``RoundStreams``), not in order with the trainer's: done before a step
                # this lets go may write them.
                for device in self._devices:
                    settle(torch.cuda.current_stream(device), self._wait_s)
                for e in self._entries:
                    if e.state == _LIVE:
                        self._check(e)
            finally:
                self._done = True
                self._cond.notify_all()

    def release(self) -> None:
        with self._cond:
            self._done = True
            self._cond.notify_all()
            for e in self._entries:
                e.copy = e.event = None
                e.live = _GONE
            self._stats.held -= self._held
            self._held = 0

    def _check(self, e: _Entry) -> None:
        if e.live._version != e.version:
            raise SnapshotChanged(
                f"{e.name!r} was written in place after send_weights(wait=False) while the "
                "round could still read it, by a write snapshot='cow' does not watch (not a "
                "torch optimizer's step, no before_update() first): the round was not "
                "committed; call engine.before_update() before such writes or use "
                "snapshot='copy'"
            )


_GONE = torch.empty(0)


class _Read:
    """A pair's tensor, resolved when the round reaches it (see ``CowSource``)."""

    __slots__ = ("entry", "round")

    def __init__(self, round_: CowRound, entry: _Entry) -> None:
        self.round, self.entry = round_, entry


class CowSource(FrozenSource):
    """The snapshot's tensors in the source's order, each the live tensor or its copy as
    decided when the round reaches it."""

    def __iter__(self) -> Any:
        for name, read in self._pairs:
            yield name, read.round.read(read.entry)


class CowSnapshots:
    """One engine's ``cow`` rounds in flight, and the optimizer hook while there are any."""

    def __init__(self, wait_s: float, streams: RoundStreams | None = None) -> None:
        self.stats = CowStats()
        self._wait_s = wait_s
        self._streams = streams or RoundStreams(wait_s)
        self._rounds: weakref.WeakSet[CowRound] = weakref.WeakSet()
        self._lock = threading.Lock()
        self._hook: Any = None

    def take(self, source: WeightSource, metas: list[ParamMeta] | None = None) -> Snapshot:
        """Reference every tensor of ``source`` and its version now (the trainer's thread);
        ``metas``: its ``metadata()``, if the caller just read it."""
        metas = source.metadata() if metas is None else metas
        entries = []
        for name, tensor in source:
            if not isinstance(tensor, torch.Tensor):
                raise WrongType(f"source yielded {type(tensor).__name__}, expected torch.Tensor")
            # detach (a new tensor object, same storage and version counter) only where
            # autograd could see the round's reads
            entries.append(_Entry(name, tensor.detach() if tensor.requires_grad else tensor))
        devices = cuda_devices(e.live for e in entries)
        r = CowRound(entries, self.stats, self._wait_s, devices)
        with self._lock:
            self._rounds.add(r)
            if self._hook is None:
                self._hook = register_optimizer_step_pre_hook(self._before_step)

        def release() -> None:
            r.release()
            with self._lock:
                self._rounds.discard(r)
                if not self._rounds and self._hook is not None:
                    self._hook.remove()
                    self._hook = None

        return Snapshot(
            CowSource(metas, r.pairs()),
            ready=r.ready,
            release=release,
            before_commit=r.before_commit,
            context=self._streams.context(devices),
        )

    def protect(self, params: Any = None) -> None:
        """Before the trainer writes ``params`` (None: every tensor of the rounds in flight)."""
        with self._lock:
            rounds = list(self._rounds)
        if not rounds:  # the usual step: the round ended before it
            return
        storages = None if params is None else {p.untyped_storage().data_ptr() for p in params}
        for r in rounds:
            r.protect(storages)

    def _before_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        self.protect(p for group in optimizer.param_groups for p in group["params"])


def _stream_event(device: torch.device) -> Any:
    """An event after the work queued so far on the calling thread's current stream."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
