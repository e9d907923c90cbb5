"""Sleep mode for the reference server's workers, with vLLM's levels.

A colocated loop is generate -> ``/sleep`` -> train -> ``/wake_up`` -> sync: while the
trainer uses the GPU, the inference side gives its memory back.

- level 0: generation is paused; nothing is freed.
- level 1: weights are offloaded to host memory; ``/wake_up`` brings them back as they were.
- level 2: weights are discarded (buffers are kept on the host); ``/wake_up``
  re-allocates them zeroed, so the next weight sync must send a full round before
  the server generates again (what vLLM's level 2 expects of an RL trainer too).

``kv_cache`` and ``scheduling`` tags are accepted: the reference server keeps no KV
cache between requests, and scheduling resumes once the weights are back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

SLEEP_LEVELS = (0, 1, 2)
WAKE_TAGS = ("weights", "kv_cache", "scheduling")


class ModelSleeper:
    """Offloads / discards one ``torch.nn.Module``'s tensors; ``level`` is what is asleep (0: awake)."""

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
