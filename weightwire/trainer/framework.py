"""``FrameworkHooks``: what a framework engine (JAX or torch) implements for ``TrainerEngine``.

A framework engine implements ``describe``, ``host_bytes`` and, for a backend that packs on
the device, ``device_packer``; the other hooks have defaults or refuse what the framework
cannot do (``flat_index`` for a receiver of patches only, ``delta_kernel`` for
``delta="auto"``, ``snapshot`` for ``send_weights(wait=False)``).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from weightwire.backends.base import DevicePacker, LocalShards, SenderParts
from weightwire.shared.dtypes import wire_dtype
from weightwire.shared.errors import ConfigError
from weightwire.shared.meta import ParamMeta
from weightwire.shared.slices import Box
from weightwire.shared.source import WeightSource
from weightwire.trainer.delta import DeltaKernel
from weightwire.trainer.slice_plan import Held, Holdings
from weightwire.trainer.snapshot import Snapshot

__all__ = ["FrameworkHooks", "framework_of", "refuse_other_framework"]

ENGINE_AND_SOURCE = {
    "jax": ("JAXTrainerEngine", "PytreeSource"),
    "torch": ("TorchTrainerEngine", "ModuleSource"),
}
"""Per framework: the engine that sends its tensors and the source that yields them."""

_FRAMEWORK_OF_PACKAGE = {
    "weightwire.jax_side": "jax",
    "jax": "jax",
    "jaxlib": "jax",
    "flax": "jax",
    "weightwire.torch_side": "torch",
    "torch": "torch",
    "peft": "torch",
    "vllm": "torch",
}
"""Where a class is defined -> the framework of the tensors it holds (vLLM's own
``ModuleSource`` yields torch tensors)."""


def framework_of(obj: Any) -> str | None:
    """``"jax"`` / ``"torch"`` when ``obj`` (a source, a tensor) belongs to that framework, told
    by the module of its class or a base class (nothing is imported); ``None`` when unknown (a
    numpy array, a user's own source)."""
    inner = getattr(obj, "inner", None)  # ``as_source``'s adapter around a source-shaped object
    for cls in type(obj).__mro__:
        module = getattr(cls, "__module__", None) or ""
        for package, framework in _FRAMEWORK_OF_PACKAGE.items():
            if module == package or module.startswith(package + "."):
                return framework
    return framework_of(inner) if inner is not None and inner is not obj else None


def refuse_other_framework(engine: str, framework: str | None, thing: Any, what: str) -> None:
    """``ConfigError`` when ``thing`` (the ``what``: a source, a tensor it yielded) belongs to
    another framework than ``engine``'s: its tensors would fail deep in the first round, with
    a message that names neither mistake."""
    theirs = framework_of(thing)
    if framework is None or theirs is None or theirs == framework:
        return
    right_engine, right_source = ENGINE_AND_SOURCE[theirs]
    _, our_source = ENGINE_AND_SOURCE[framework]
    raise ConfigError(
        f"{engine} sends {_TENSORS[framework]}, but the {what} is a {_NAME[theirs]} "
        f"{type(thing).__name__}: use {right_engine} with {right_source} for a {_NAME[theirs]} "
        f"model, or {engine} with a {our_source}"
    )


_NAME = {"jax": "JAX", "torch": "PyTorch"}
_TENSORS = {"jax": "JAX arrays", "torch": "torch tensors"}


class FrameworkHooks(ABC):
    """The framework's part of a trainer engine: tensors described, read and packed."""

    framework: ClassVar[str | None] = None
    """``"jax"`` / ``"torch"``: whose tensors this engine sends (a source of the other one is
    refused at ``trainer_init``); ``None``: any."""

    @abstractmethod
    def describe(self, tensor: Any) -> tuple[str, tuple[int, ...]]:
        """``(wire dtype name, shape)`` of a yielded tensor."""

    @abstractmethod
    def host_bytes(self, tensor: Any) -> np.ndarray:
        """The tensor's C-order little-endian bytes as a flat ``uint8`` host array."""

    def prefetch_host(self, tensors: list[Any]) -> None:
        """Start device-to-host copies of a chunk before ``host_bytes`` is called."""
        return None

    def device_packer(self, device: int | None) -> DevicePacker:
        raise NotImplementedError(f"{type(self).__name__} cannot pack on a device")

    def sender_parts(self, packer: DevicePacker | None) -> SenderParts:
        """What this engine lends a backend's data path."""
        return SenderParts(self.host_bytes, self.prefetch_host, packer)

    def flat_index(self, n: int, like: Any) -> Any:
        """A 1-D ``int32`` array ``0..n-1`` where ``like`` lives (a tensor patched whole, for a
        receiver of patches only)."""
        raise NotImplementedError(f"{type(self).__name__} has no flat_index")

    def delta_kernel(self) -> DeltaKernel:
        """The device kernels of ``delta="auto"`` rounds (``trainer.delta``)."""
        raise NotImplementedError(f"{type(self).__name__} has no delta kernels")

    def process_rank(self) -> int:
        """This trainer process's rank in the holdings ``slice_holdings`` describes."""
        return 0

    def process_count(self) -> int:
        """How many trainer processes share the source's arrays (several: their passes
        over the source take part in collectives, so one process alone cannot read them
        sliced)."""
        return 1

    def slice_holdings(self, tensors: Mapping[str, Any]) -> Holdings:
        """Which trainer rank holds which box of each tensor (sliced rounds; metadata
        only). Default: every tensor whole, on this process."""
        rank = self.process_rank()
        shapes = {n: self.describe(t)[1] for n, t in tensors.items()}
        return Holdings.of(shapes, [Held(n, rank, Box.whole(s)) for n, s in shapes.items()])

    def local_shards(self, tensors: Mapping[str, Any], device: int | None) -> LocalShards:
        """This process's devices as the trainer ranks of a backend with
        ``SenderCaps.local_shards``, told by ``tensors`` (the source's first tensor, as
        ``sliced_source`` yields it; empty for a source of none): its ``boxes`` and ``shards``
        then read every tensor of the session. Default: one rank, on ``device`` (or 0),
        holding every tensor whole."""
        return WholeOnOneDevice(0 if device is None else device, self.describe)

    def sliced_source(self, source: WeightSource) -> WeightSource:
        """The source a sliced round reads: one whose tensors stay where they are held
        (not gathered to one device). Default: ``source`` itself."""
        return source

    def read_box(self, tensor: Any, box: Box) -> np.ndarray:
        """``box`` of ``tensor`` as a C-contiguous little-endian host array (its bytes, in
        any numpy dtype), cut from what this process holds. Default: from the whole
        tensor's host bytes."""
        dtype, shape = self.describe(tensor)
        flat = self.host_bytes(tensor)
        cells = flat.reshape(*shape, wire_dtype(dtype).itemsize)
        return np.ascontiguousarray(cells[box.slices()])

    def cut_box(self, tensor: Any, box: Box) -> Any:
        """``box`` of ``tensor`` as a device array cut on the device of the shard that holds
        it (an on-device sliced sender packs it: ``RoundSender.device_pieces``). Default:
        ``read_box``'s host array (the sender copies it up)."""
        return self.read_box(tensor, box)

    def tensor_sha256(self, tensor: Any) -> str:
        return hashlib.sha256(
            self.host_bytes(tensor).data
        ).hexdigest()  # .data: the array's memoryview

    def snapshot(self, source: WeightSource, metas: list[ParamMeta] | None = None) -> Snapshot:
        """The weights an overlapped round sends, fixed now, on the trainer's thread.
        ``metas``: ``source.metadata()`` when the caller has just read it (not read again)."""
        raise ConfigError(
            f"{type(self).__name__} cannot take a snapshot for send_weights(wait=False)"
        )


class WholeOnOneDevice(LocalShards):
    """One trainer rank holding every tensor whole: its shard is the tensor itself."""

    def __init__(self, device: int, describe: Any) -> None:
        self._device, self._describe = device, describe

    @property
    def devices(self) -> list[int]:
        return [self._device]

    def boxes(self, name: str, tensor: Any) -> list[Box]:
        return [Box.whole(self._describe(tensor)[1])]

    def shards(self, name: str, tensor: Any) -> list[Any]:
        return [tensor]
