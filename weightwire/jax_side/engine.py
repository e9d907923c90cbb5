"""``JAXTrainerEngine``: push a JAX trainer's weights into vLLM, torch-free.

Usage (identical for ``TorchTrainerEngine``, with a ``ModuleSource``)::

    client = HTTPWeightSyncClient("http://vllm:8000")
    engine = JAXTrainerEngine.trainer_init(
        TrainerInitInfo(backend="nccl"), client=client, source=PytreeSource(params, naming))
    for step in ...:
        ...train...
        engine.send_weights()          # every trainer rank calls it
    engine.shutdown()

Overlapped (the next step trains while the round streams)::

    handle = engine.send_weights(wait=False)   # returns after a snapshot: array references

The round protocol lives in ``weightwire.trainer.engine``; this class only says how
a JAX array is described, read back to the host (TCP) and packed on the GPU (NCCL).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from weightwire.backends.base import DevicePacker, LocalShards
from weightwire.jax_side.delta import JaxDeltaKernel, Prefix
from weightwire.jax_side.dtypes import describe as _describe
from weightwire.jax_side.dtypes import is_array
from weightwire.jax_side.source import PytreeSource
from weightwire.shared.meta import ParamMeta
from weightwire.shared.slices import Box
from weightwire.shared.source import WeightSource
from weightwire.trainer.delta import DeltaKernel
from weightwire.trainer.engine import TrainerEngine
from weightwire.trainer.fp8_source import Fp8Source
from weightwire.trainer.framework import refuse_other_framework
from weightwire.trainer.slice_plan import Held, Holdings
from weightwire.trainer.snapshot import FrozenSource, Snapshot


def _kept(tensor: Any) -> Any:
    """What a snapshot holds of a tensor: a jax.Array itself, a copy of a mutable one."""
    if is_array(tensor):
        return tensor
    return np.array(tensor, copy=True)


def _on_host(array: jax.Array) -> bool:
    return all(d.platform == "cpu" for d in array.devices())


class JAXTrainerEngine(TrainerEngine):
    """Trainer engine over a ``WeightSource`` yielding JAX (or numpy) arrays."""

    framework = "jax"

    def describe(self, tensor: Any) -> tuple[str, tuple[int, ...]]:
        if isinstance(tensor, Prefix):  # a delta round's patch (a bucketed kernel output)
            return tensor.describe()
        try:
            return _describe(tensor)
        except (TypeError, ValueError, AttributeError):
            # A user's own source yielding torch tensors: say so, not "torch.float32 is not a
            # dtype" (checked only here, on the failure path: a round describes every tensor).
            refuse_other_framework(type(self).__name__, self.framework, tensor, "source's tensor")
            raise

    def host_bytes(self, tensor: Any) -> np.ndarray:
        # np.asarray on a jax.Array is a device_get (zero-copy for CPU arrays).
        array = tensor.host() if isinstance(tensor, Prefix) else np.asarray(tensor)
        if array.dtype.byteorder == ">":  # the wire is little-endian
            array = array.astype(array.dtype.newbyteorder("<"))
        return np.ascontiguousarray(array).reshape(-1).view(np.uint8)

    def process_rank(self) -> int:
        return int(jax.process_index())

    def process_count(self) -> int:
        return int(jax.process_count())

    def slice_holdings(self, tensors: Mapping[str, Any]) -> Holdings:
        """A ``jax.Array``'s boxes per process from its sharding (``jax_side.holdings``: no
        data moves); anything else whole on this process."""
        from weightwire.jax_side.holdings import array_holdings

        rank = self.process_rank()
        held: list[Held] = []
        for name, tensor in tensors.items():
            if isinstance(tensor, jax.Array):
                held += array_holdings(name, tensor)
            else:
                held.append(Held(name, rank, Box.whole(self.describe(tensor)[1])))
        return Holdings.of({n: self.describe(t)[1] for n, t in tensors.items()}, held)

    def sliced_source(self, source: WeightSource) -> WeightSource:
        """A ``PytreeSource``'s outputs left sharded (``PytreeSource.sharded``), also under
        an ``Fp8Source``: its quantizer then runs on the shards (each keeps its sharding
        where the shards hold whole blocks; a block cut by a shard boundary is reduced
        across the devices holding it by XLA, never gathered whole by weightwire)."""
        if isinstance(source, Fp8Source):
            return source.over(self.sliced_source(source.inner))
        return source.sharded() if isinstance(source, PytreeSource) else source

    def local_shards(self, tensors: Mapping[str, Any], device: int | None) -> LocalShards:
        """This process's devices as trainer ranks, in the first sharded array's mesh order;
        each rank's part of an array the shard its device holds (``holdings.JaxLocalShards``)."""
        from weightwire.jax_side.holdings import JaxLocalShards

        return JaxLocalShards.of(tensors, device)

    def read_box(self, tensor: Any, box: Box) -> np.ndarray:
        """From the addressable shard holding ``box`` (``jax_side.holdings.read_box``): only
        the box's elements leave the device; a sharded array is never gathered."""
        if not isinstance(tensor, jax.Array):
            return super().read_box(tensor, box)
        from weightwire.jax_side.holdings import read_box

        array = read_box(tensor, box, rank=self.process_rank())
        if array.dtype.byteorder == ">":  # the wire is little-endian
            array = array.astype(array.dtype.newbyteorder("<"))
        return np.ascontiguousarray(array)

    def cut_box(self, tensor: Any, box: Box) -> Any:
        """The box as an array on the device of the addressable shard holding it
        (``jax_side.holdings.cut_box``): nothing leaves the device, nothing is gathered."""
        if not isinstance(tensor, jax.Array):
            return super().cut_box(tensor, box)
        from weightwire.jax_side.holdings import cut_box

        return cut_box(tensor, box, rank=self.process_rank())

    def prefetch_host(self, tensors: list[Any]) -> None:
        # Start every device-to-host copy of the chunk before the first one is awaited. Not
        # for an array in host memory already: nothing to overlap, and the call leaves a
        # single-device array and its sharding on each (two objects per wire tensor alive
        # through the round: a delta round's hundreds, promoted by its young collections
        # towards a full one, #49).
        for tensor in tensors:
            if isinstance(tensor, Prefix):
                tensor = tensor.array
            if isinstance(tensor, jax.Array) and not _on_host(tensor):
                tensor.copy_to_host_async()

    def delta_kernel(self) -> DeltaKernel:
        return JaxDeltaKernel()

    def flat_index(self, n: int, like: Any) -> Any:
        index = jax.numpy.arange(n, dtype=jax.numpy.int32)
        devices = like.devices() if isinstance(like, jax.Array) else ()
        return jax.device_put(index, next(iter(devices))) if len(devices) == 1 else index

    def device_packer(self, device: int | None) -> DevicePacker:
        from weightwire.jax_side.packer import JaxDevicePacker

        return JaxDevicePacker(device)

    def snapshot(self, source: WeightSource, metas: list[ParamMeta] | None = None) -> Snapshot:
        """References, no copy: JAX arrays are immutable (numpy arrays are copied). An
        ``Fp8Source`` is snapshot beneath its quantizer: the round quantizes the arrays of
        the call on its own thread (a sharded ``PytreeSource`` stays sharded)."""
        if isinstance(source, Fp8Source):
            inner = self.snapshot(source.inner)  # the inner source's metadata is its own
            return dataclasses.replace(inner, source=source.over(inner.source))
        if isinstance(source, PytreeSource):
            return Snapshot(source.frozen())
        metas = source.metadata() if metas is None else metas
        pairs = [(name, _kept(tensor)) for name, tensor in source]
        return Snapshot(FrozenSource(metas, pairs))
