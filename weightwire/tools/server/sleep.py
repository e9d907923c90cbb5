"""Sleep mode for the reference server's workers, with vLLM's levels.

A colocated loop is generate -> ``/sleep`` -> train -> ``/wake_up`` -> sync: while the
trainer uses the GPU, the inference side gives its memory back.

- level 0: generation is paused; nothing is freed.
- level 1: weights are offloaded to host memory; ``/wake_up`` brings them back as they were.
- level 2: weights are discarded (buffers are kept on the host); ``/wake_up``
  re-allocates them zeroed, so the next weight sync must send a full round before
  the server generates again (what vLLM's level 2 expects of an RL trainer too).
  Until every discarded tensor was sent again, generation is refused (503) instead
  of computing with zeros (``WorkerSleep.check_serving``).

A sleep waits for the model lock (a generation may hold it) at most its ``timeout_s``
and never sleeps after a ``cancel_sleep`` that arrived while it waited: the API has
then answered "did not sleep", and a sleep landing later would contradict it (the
same rule as a finish that timed out).

``kv_cache`` and ``scheduling`` tags are accepted: the reference server keeps no KV
cache between requests, and scheduling resumes once the weights are back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from weightwire.shared.errors import ReferenceServerError

SLEEP_LEVELS = (0, 1, 2)
WAKE_TAGS = ("weights", "kv_cache", "scheduling")


class ModelSleeper:
    """Offloads / discards one ``torch.nn.Module``'s tensors; ``level`` is what is asleep (0:
    awake)."""

    def __init__(self, model: Any, device: Any) -> None:
        self.model, self.device = model, device
        self.level = 0
        self._shapes: list[tuple[Any, tuple[int, ...], Any]] = []

    def sleep(self, level: int) -> int:
        """Returns the device bytes freed (0 at level 0, or when already asleep)."""
        import torch

        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep level must be one of {SLEEP_LEVELS}, got {level!r}")
        if level == 0 or self.level:
            return 0
        params = list(self.model.parameters())
        freed = sum(p.numel() * p.element_size() for p in params if p.device.type != "cpu")
        if level == 1:
            self.model.to("cpu")
        else:
            for buf in self.model.buffers():
                buf.data = buf.data.to("cpu")
            self._shapes = [(p, tuple(p.shape), p.dtype) for p in params]
            for p in params:
                p.data = torch.empty(0, dtype=p.dtype)  # the same Parameter objects, no storage
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.level = level
        return freed

    def shape_of(self, param: Any) -> tuple[int, ...] | None:
        """The shape ``param`` takes back at ``wake`` when level 2 discarded it (its storage
        is empty until then); None for a parameter that holds its own."""
        for p, shape, _ in self._shapes:
            if p is param:
                return shape
        return None

    def wake(self, tags: Sequence[str] | None) -> bool:
        """Bring back what ``tags`` name (None: everything); True once fully awake."""
        import torch

        unknown = [t for t in tags or () if t not in WAKE_TAGS]
        if unknown:
            raise ValueError(f"unknown wake_up tags {unknown}; known: {list(WAKE_TAGS)}")
        if self.level and (tags is None or "weights" in tags):
            if self.level == 1:
                self.model.to(self.device)
            else:
                for buf in self.model.buffers():
                    buf.data = buf.data.to(self.device)
                for p, shape, dtype in self._shapes:
                    p.data = torch.zeros(shape, dtype=dtype, device=self.device)
                self._shapes = []
            self.level = 0
        return self.level == 0


class WeightsUnavailable(ReferenceServerError):
    """Generation refused: the weights are asleep, or level 2 discarded some that no round
    resent."""


class SleepCancelled(ReferenceServerError):
    """A sleep the API gave up on (``cancel_sleep``) before it could run; nothing slept."""


_LOCK_POLL_S = 0.05


def acquire_within(
    lock: threading.Lock,
    timeout_s: float | None,
    cancelled: Callable[[], bool],
    busy: str,
    on_cancel: str,
) -> None:
    """Take ``lock``, polling: raise ``SleepCancelled(on_cancel)`` once ``cancelled()``, or
    ``TimeoutError(busy)`` after ``timeout_s`` (None: no bound). Holds it on return."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not lock.acquire(timeout=_LOCK_POLL_S):
        if cancelled():
            raise SleepCancelled(on_cancel)
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(busy)
    if cancelled():
        lock.release()
        raise SleepCancelled(on_cancel)


class WorkerSleep:
    """A worker's sleep state: the ``ModelSleeper``, the cancel epoch, and which weights
    level 2 discarded that no committed round has written since (``missing``).

    ``sleep`` / ``wake`` / ``committed`` run on the worker's control lane (one at a
    time); ``cancel`` on its stdin reader; ``check_serving`` on the serve lane under the
    model lock.
    """

    def __init__(
        self, model: Any, device: Any, lock: threading.Lock, names: Callable[[], Iterable[str]]
    ) -> None:
        self.sleeper = ModelSleeper(model, device)
        self.lock, self._names = lock, names
        self.epoch = 0
        """Bumped by ``cancel``: a sleep that arrived before it never runs."""
        self.missing: set[str] = set()

    def cancel(self) -> None:
        self.epoch += 1

    def reply(self, **extra: Any) -> dict[str, Any]:
        return {"level": self.sleeper.level, "discarded": len(self.missing), **extra}

    def sleep(self, level: int, epoch: int, timeout_s: float | None = None) -> dict[str, Any]:
        bound = "" if timeout_s is None else f" for {timeout_s:g} s"
        acquire_within(
            self.lock,
            timeout_s,
            lambda: self.epoch != epoch,
            busy=f"the model stayed busy (a generation held it){bound}, so this "
            "replica did not sleep",
            on_cancel="the sleep was cancelled while it waited for the model; this "
            "replica did not sleep",
        )
        try:
            was = self.sleeper.level
            freed = self.sleeper.sleep(level)
            if level == 2 and not was:
                self.missing = set(self._names())
        finally:
            self.lock.release()
        return self.reply(freed_bytes=freed)

    def wake(self, tags: Sequence[str] | None) -> dict[str, Any]:
        if (
            not self.sleeper.level
        ):  # awake already: nothing to do, and no reason to wait for a generation
            return self.reply(awake=True)
        with self.lock:
            awake = self.sleeper.wake(tags)
        return self.reply(awake=awake)

    def committed(self, names: Iterable[str]) -> None:
        self.missing.difference_update(names)

    def check_round(self) -> None:
        """Refuse a round's start while the weights are offloaded or discarded (not woken)."""
        if self.sleeper.level:
            raise RuntimeError(
                f"the model's weights are asleep (/sleep level {self.sleeper.level}): POST "
                "/wake_up?tags=weights before starting a weight update"
            )

    def check_serving(self) -> None:
        if self.sleeper.level:
            raise WeightsUnavailable(
                f"the model is asleep (/sleep level {self.sleeper.level}); POST /wake_up first"
            )
        if self.missing:
            first = sorted(self.missing)[0]
            raise WeightsUnavailable(
                f"the weights were discarded by /sleep?level=2 and {len(self.missing)} of them "
                f"have not been sent since (e.g. {first!r}); send a full weight round before "
                "generating"
            )
