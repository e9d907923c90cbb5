"""Multi-process JAX trainers (``jax.distributed``, one process per host).

With params sharded across processes no leaf is fully addressable, so a plain
``PytreeSource`` holds nothing. ``MultiProcessSource`` instead:

- assigns every layer group a broadcaster process: contiguous runs of layer groups,
  balanced by bytes, in process order (so turn order is metadata order, rule 3 of
  ``trainer.broadcast_plan``) and declared as ``ParamMeta.owners``;
- on iteration, every process runs the same jitted transform + all-gather for each
  layer group, in lockstep and in metadata order (XLA collectives over the global
  mesh, never through the host); the group's broadcaster keeps its copy on its target
  device and yields it, the others drop theirs at once. At most one layer group is
  gathered at a time per process.

Every process must iterate every pass (the engine does: ranks outside a turn still
iterate), or the others block in the collective. ``JaxProcessGroup`` is the
``TrainerGroup`` over ``jax.distributed``'s coordination service, whose reads take
a timeout.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import jax

from weightwire.jax_side.naming import Naming
from weightwire.jax_side.source import PytreeSource
from weightwire.shared.errors import NotInitialized
from weightwire.shared.groups import layerwise_groups
from weightwire.shared.meta import ParamMeta
from weightwire.trainer.group import StoreGroup


def assign_broadcasters(groups: list[list[ParamMeta]], processes: int) -> list[int]:
    """Broadcaster process of each layer group: contiguous, ascending, balanced by bytes.

    A group goes to process ``p`` while the bytes before its midpoint are below
    ``(p + 1) / processes`` of the total, so every process gets a share when there are at
    least as many groups as processes, and process 0 always gets the first group.
    """
    sizes = [sum(m.nbytes for m in g) for g in groups]
    total = sum(sizes) or 1
    out, before = [], 0
    for size in sizes:
        mid = before + size / 2
        out.append(min(processes - 1, int(mid * processes / total)))
        before += size
    return out


class MultiProcessSource(PytreeSource):
    """``PytreeSource`` over arrays sharded across ``jax.distributed`` processes.

    Same arguments as ``PytreeSource``; ``process`` / ``processes`` default to
    ``jax.process_index()`` / ``jax.process_count()``.
    """

    def __init__(
        self,
        params: Any,
        naming: Naming,
        *,
        dtype: Any = None,
        device: Any = None,
        process: int | None = None,
        processes: int | None = None,
    ) -> None:
        self._process = jax.process_index() if process is None else process
        self._processes = jax.process_count() if processes is None else processes
        self._owners: dict[str, int] = {}
        super().__init__(params, naming, dtype=dtype, device=device)

    def __repr__(self) -> str:
        return (
            f"MultiProcessSource({len(self._metas)} tensors, process {self._process} of "
            f"{self._processes})"
        )

    def _assigned(self) -> list[ParamMeta]:
        groups = layerwise_groups(self._metas)
        who = assign_broadcasters(groups, self._processes)
        self._owners = {m.name: p for g, p in zip(groups, who, strict=True) for m in g}
        return [replace(m, owners=(self._owners[m.name],)) for m in self._metas]

    def metadata(self) -> list[ParamMeta]:
        super().metadata()
        metas = self._assigned()
        self._declared = metas
        return list(metas)

    def held_names(self) -> set[str] | None:
        """The names this process broadcasts (it gathers them itself)."""
        self._current()
        self._assigned()
        return {n for n, p in self._owners.items() if p == self._process}

    def __iter__(self) -> Iterator[tuple[str, jax.Array]]:
        """This process's share, in metadata order, while running every group's gathers."""
        plan, leaves = self._current()
        metas = self._assigned()
        by_name = {e.name: e for e in plan.entries}
        for group in layerwise_groups(metas):
            batch = [by_name[m.name] for m in group]
            arrays = self._run(plan, leaves, batch)  # collective: every process, every group
            if group[0].owners == (self._process,):
                for entry, array in zip(batch, arrays, strict=True):
                    yield entry.name, array
            del arrays  # a non-broadcaster frees the group now; a broadcaster once it asks for more

    def iter_groups(self) -> Iterator[list[tuple[str, jax.Array]]]:
        from weightwire.shared.groups import batch_by_layer

        return batch_by_layer(iter(self))


class JaxProcessGroup(StoreGroup):
    """``TrainerGroup`` over the ``jax.distributed`` coordination service's key-value store."""

    def __init__(self) -> None:
        from jax._src.distributed import global_state  # the public API has no KV store

        if global_state.client is None:
            raise NotInitialized(
                "JaxProcessGroup needs jax.distributed.initialize() first: call it on every "
                "process before building the group"
            )
        super().__init__(jax.process_index(), jax.process_count())
        self._client = global_state.client

    @property
    def store(self) -> object:
        return self._client

    def _set(self, key: str, value: str) -> None:
        self._client.key_value_set(key, value)

    def _get(self, key: str, timeout: float) -> str:
        # XLA raises a runtime error (DEADLINE_EXCEEDED) on timeout: StoreGroup.read names the key
        return self._client.blocking_key_value_get(key, max(1, int(timeout * 1000)))

    @property
    def beats(self) -> bool:
        # jaxlib's client gained a non-blocking read (key_value_try_get) after 0.4.30
        return hasattr(self._client, "key_value_try_get")

    def _put(self, key: str, value: str) -> None:
        try:
            self._client.key_value_set(key, value, allow_overwrite=True)
        except TypeError:  # a jaxlib without allow_overwrite: a reader may see no beat a moment
            self._client.key_value_delete(key)
            self._client.key_value_set(key, value)

    def _peek(self, key: str) -> str | None:
        try:
            return self._client.key_value_try_get(key)
        except Exception as exc:  # XLA's NOT_FOUND is a plain runtime error
            if str(exc).startswith("NOT_FOUND"):
                return None
            raise
