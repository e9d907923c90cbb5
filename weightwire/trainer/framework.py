"""``FrameworkHooks``: what a framework engine (JAX or torch) implements for ``TrainerEngine``.

A framework engine implements ``describe``, ``host_bytes`` and, for a backend that packs on
the device, ``device_packer``; the other hooks have defaults or refuse what the framework
cannot do (``flat_index`` for a receiver of patches only, ``delta_kernel`` for
``delta="auto"``, ``snapshot`` for ``send_weights(wait=False)``).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from weightwire.backends.base import DevicePacker, SenderParts
from weightwire.shared.errors import ConfigError
from weightwire.shared.source import WeightSource
from weightwire.trainer.delta import DeltaKernel
from weightwire.trainer.snapshot import Snapshot

__all__ = ["FrameworkHooks"]


class FrameworkHooks(ABC):
    """The framework's part of a trainer engine: tensors described, read and packed."""

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

    def tensor_sha256(self, tensor: Any) -> str:
        return hashlib.sha256(
            self.host_bytes(tensor).data
        ).hexdigest()  # .data: the array's memoryview

    def snapshot(self, source: WeightSource) -> Snapshot:
        """The weights an overlapped round sends, fixed now, on the trainer's thread."""
        raise ConfigError(
            f"{type(self).__name__} cannot take a snapshot for send_weights(wait=False)"
        )
