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

from weightwire.shared.meta import ParamMeta
from weightwire.shared.source import WeightSource
from weightwire.torch_side.sender.snapshot import (
    RoundStreams,
    copy_all,
    cuda_devices,
    device_wait,
    settle,
    source_tensor,
)
from weightwire.trainer.overlap import RoundWaitTimeout
from weightwire.trainer.snapshot import FrozenSource, Snapshot, SnapshotChanged

_PENDING, _LIVE, _COPIED = 0, 1, 2  # a tensor's state in ``CowRound._states``


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


class CowRound:
    """One round's copy-on-write snapshot (see the module docstring).

    Per tensor, parallel lists indexed by its place in the source (no object per tensor: a
    snapshot is taken on the trainer's thread at every overlapped call, and a few hundred
    allocations there are also the garbage collector's next pass)."""

    def __init__(
        self,
        names: list[str],
        lives: list[torch.Tensor],
        stats: CowStats,
        wait_s: float,
        devices: list[int],
    ) -> None:
        self.names = names
        self._lives = lives
        self._versions = [t._version for t in lives]
        self._storages: list[int] | None = None  # looked up when a write first asks (one
        # after the round ended never does)
        self._states = bytearray(len(lives))  # _PENDING
        self._copies: dict[int, torch.Tensor] = {}
        self._events: dict[int, Any] = {}  # a CUDA copy's event on the trainer's stream
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
            lives, states = self._lives, self._states
            if storages is None:
                hit: Any = range(len(lives))
            else:
                if self._storages is None:
                    self._storages = [t.untyped_storage().data_ptr() for t in lives]
                hit = [i for i, ptr in enumerate(self._storages) if ptr in storages]
            # A counter already moved: the round refuses the tensor when it gets there (a copy
            # now would be of the new values).
            versions = self._versions
            due = [i for i in hit if states[i] == _PENDING and lives[i]._version == versions[i]]
            copies = [torch.empty_like(lives[i]) for i in due]
            copy_all(copies, [lives[i] for i in due])  # one foreach copy, not a clone each
            copied = 0
            events: dict[int, Any] = {}
            for i, c in zip(due, copies, strict=True):
                self._copies[i] = c
                states[i] = _COPIED
                copied += c.nbytes
                if c.is_cuda:  # one event per device, after every copy of this call
                    device = c.get_device()
                    event = events.get(device)
                    if event is None:
                        event = events[device] = _stream_event(device)
                    self._events[i] = event
            if copied:
                self._held += copied
                self._stats.add(copied)
            start = time.monotonic()
            deadline = start + self._wait_s
            while not self._done and any(states[i] == _LIVE for i in hit):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RoundWaitTimeout(
                        f"a parameter write waited {self._wait_s:.0f} s for an overlapped round "
                        "(snapshot='cow') to finish reading the tensors it was handed"
                    )
                self._cond.wait(left)
            self._stats.waited_s += time.monotonic() - start

    # -- the round's thread
    def read(self, i: int) -> torch.Tensor:
        with self._cond:
            if self._states[i] == _COPIED:
                copy = self._copies[i]
                event = self._events.get(i)
                if event is not None:
                    torch.cuda.current_stream(copy.device).wait_event(event)
                return copy
            self._check(i)
            self._states[i] = _LIVE
            return self._lives[i]

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
                for i, state in enumerate(self._states):
                    if state == _LIVE:
                        self._check(i)
            finally:
                self._done = True
                self._cond.notify_all()

    def release(self) -> None:
        with self._cond:
            self._done = True
            self._cond.notify_all()
            self._copies.clear()
            self._events.clear()
            self._lives = []
            self._stats.held -= self._held
            self._held = 0

    def _check(self, i: int) -> None:
        if self._lives[i]._version != self._versions[i]:
            raise SnapshotChanged(
                f"{self.names[i]!r} was written in place after send_weights(wait=False) while "
                "the round could still read it, by a write snapshot='cow' does not watch (not "
                "a torch optimizer's step, no before_update() first): the round was not "
                "committed; call engine.before_update() before such writes or use "
                "snapshot='copy'"
            )


class CowSource(FrozenSource):
    """The snapshot's tensors in the source's order, each the live tensor or its copy as
    decided when the round reaches it."""

    def __init__(self, metas: list[ParamMeta], round_: CowRound) -> None:
        super().__init__(metas, [])
        self._round = round_

    def __repr__(self) -> str:
        return f"CowSource({len(self._round.names)} tensors)"

    def __iter__(self) -> Any:
        read = self._round.read
        for i, name in enumerate(self._round.names):
            yield name, read(i)


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
        names: list[str] = []
        lives: list[torch.Tensor] = []
        for name, tensor in source:
            tensor = source_tensor(tensor, name)
            names.append(name)
            # detach (a new tensor object, same storage and version counter) only where
            # autograd could see the round's reads
            lives.append(tensor.detach() if tensor.requires_grad else tensor)
        devices = cuda_devices(lives)
        r = CowRound(names, lives, self.stats, self._wait_s, devices)
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
            CowSource(metas, r),
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


def _stream_event(device: int) -> Any:
    """An event after the work queued so far on the calling thread's current stream."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event
