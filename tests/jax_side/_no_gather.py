"""The no-gather guard of the sharded delta scripts (``_shard_delta_cases``,
``tests/trainer/_sliced_delta_jax_mesh``): inside ``no_whole_copies`` every gather entry
point (``jax_side.placement``: ``Target.move``, ``_replicate_on``; a multi-device array's
``host_bytes``) raises, and every step of a delta extraction (``JaxDeltaKernel``'s scan,
extract, refresh, first, snapshot) checks that no live array is a whole copy of a sharded
one (``whole_copies``). Importing it initialises no JAX backend."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Collection, Iterable, Iterator
from typing import Any

import jax

from weightwire.jax_side import placement
from weightwire.jax_side.delta import JaxDeltaKernel
from weightwire.jax_side.engine import JAXTrainerEngine


def forbidden(what: str) -> Any:
    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError(f"{what} during a sharded delta round: a whole array was asked")

    return refuse


def whole_copies(shapes: Collection[tuple[int, ...]]) -> list[str]:
    """Live arrays of a guarded shape (a sharded tensor's; no replicated tensor's) that hold it
    whole: replicated over several devices, or on one device and not a shard of such an array
    (a replicated tensor's shards are whole by design): gathered copies."""
    live = [a for a in jax.live_arrays() if not a.is_deleted()]
    replicas = {
        s.data.unsafe_buffer_pointer()
        for a in live
        if len(a.sharding.device_set) > 1 and a.is_fully_replicated
        for s in a.addressable_shards
    }
    return [
        f"{a.shape} on {a.sharding}"
        for a in live
        if tuple(a.shape) in shapes
        and a.size > 1
        and (
            a.is_fully_replicated  # an all-gather's output: every device the whole array
            if len(a.sharding.device_set) > 1
            else a.unsafe_buffer_pointer() not in replicas
        )
    ]


def _checked(step: Callable[..., Any], shapes: Collection[tuple[int, ...]]) -> Any:
    @functools.wraps(step)
    def run(*args: Any, **kw: Any) -> Any:
        got = step(*args, **kw)
        jax.block_until_ready([a for a in jax.live_arrays() if not a.is_deleted()])
        found = whole_copies(shapes)
        assert not found, f"{step.__name__}: whole copies of sharded arrays: {found}"
        return got

    return run


@contextlib.contextmanager
def no_whole_copies(shapes: Collection[tuple[int, ...]]) -> Iterator[None]:
    """The guard (module docstring) over ``shapes``: the sharded tensors' shapes (``guarded``)."""
    host_bytes = JAXTrainerEngine.host_bytes

    def sharded_host_bytes(self: Any, tensor: Any) -> Any:
        if isinstance(tensor, jax.Array) and len(tensor.sharding.device_set) > 1:
            raise AssertionError(f"host_bytes of a sharded array of shape {tensor.shape}")
        return host_bytes(self, tensor)

    saved: dict[tuple[Any, str], Any] = {}
    swaps: list[tuple[Any, str, Any]] = [
        (placement.Target, "move", forbidden("Target.move")),
        (placement, "_replicate_on", forbidden("_replicate_on")),
        (JAXTrainerEngine, "host_bytes", sharded_host_bytes),
    ]
    swaps += [
        (JaxDeltaKernel, n, _checked(getattr(JaxDeltaKernel, n), shapes))
        for n in ("scan", "extract", "refresh", "first", "snapshot")
    ]
    for owner, name, stand_in in swaps:
        saved[(owner, name)] = getattr(owner, name)
        setattr(owner, name, stand_in)
    try:
        yield
    finally:
        for (owner, name), was in saved.items():
            setattr(owner, name, was)


def guarded(arrays: Iterable[jax.Array]) -> set[tuple[int, ...]]:
    """The shapes of the split arrays among ``arrays`` that no replicated one has."""
    arrays = list(arrays)
    whole = {tuple(a.shape) for a in arrays if a.is_fully_replicated}
    return {tuple(a.shape) for a in arrays if not a.is_fully_replicated} - whole
