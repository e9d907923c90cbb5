"""``Target``: the one device a ``PytreeSource`` places its yielded arrays on, reached
device to device only (a sharded array is gathered by XLA over the devices' own links,
never through the host).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from weightwire.shared.errors import ConfigError

__all__ = ["Target", "device_ids", "replicated"]


class Target:
    """One device and its single-device sharding."""

    __slots__ = ("device", "sharding")

    def __init__(self, device: jax.Device) -> None:
        self.device = device
        self.sharding = SingleDeviceSharding(device)

    def holds(self, x: Any) -> bool:
        """Is ``x`` a ``jax.Array`` already whole in the target device's memory?"""
        if not isinstance(x, jax.Array):
            return False
        sharding = x.sharding
        if sharding == self.sharding:  # the common case, one comparison (per tensor, per round)
            return True
        # memory_kind: a pinned-host array on the right device is still host memory.
        return sharding.device_set == {self.device} and sharding.memory_kind in (
            None,
            self.sharding.memory_kind,
        )

    def move(self, x: jax.Array) -> jax.Array:
        """``x`` whole on the target device, device to device only.

        ``jax.device_put`` of a multi-device array onto one device takes a slow path
        through host memory on GPU (seen with jax 0.11: a D2H copy per shard). Instead
        the array is all-gathered on its own devices by XLA (replicated output sharding)
        and the target's replica is taken as is, or copied over from another device.
        """
        if len(x.sharding.device_set) > 1:
            if not x.is_fully_replicated:
                where = replicated(x.sharding)
                if where is None:
                    raise ConfigError(
                        f"cannot gather an array with sharding {x.sharding} on device; "
                        "use NamedSharding or a single device"
                    )
                x = _replicate_on(where)(x)
            shards = {s.device: s.data for s in x.addressable_shards}
            x = shards.get(self.device, next(iter(shards.values())))
        return x if self.holds(x) else jax.device_put(x, self.sharding)

    def upload(self, x: Any) -> jax.Array:
        # Host (numpy) leaves must be uploaded somewhere; the target is where they end up.
        return x if isinstance(x, jax.Array) else jax.device_put(x, self.sharding)


@functools.lru_cache(maxsize=64)
def _replicate_on(where: jax.sharding.Sharding) -> Callable[[jax.Array], jax.Array]:
    """A jitted identity whose output is replicated over ``where``: XLA all-gathers the
    shards over the devices' own links, never through the host."""
    return jax.jit(lambda a: a, out_shardings=where)


def device_ids(x: jax.Array) -> tuple[int, ...]:
    devices: set[Any] = (
        x.sharding.device_set
    )  # jaxlib's Device has no stub: its .id is unknown to mypy
    return tuple(sorted(d.id for d in devices))


def replicated(sharding: jax.sharding.Sharding) -> jax.sharding.Sharding | None:
    """A replicated sharding over ``sharding``'s devices, so the layer-index vector is
    placed explicitly (no implicit host-to-device transfer inside the jitted call)."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    if len(sharding.device_set) == 1:
        return SingleDeviceSharding(next(iter(sharding.device_set)))
    return None  # other sharding kinds: let jit place the (tiny) index vector itself
