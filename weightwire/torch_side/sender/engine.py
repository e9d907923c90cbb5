"""``TorchTrainerEngine``: the JAX engine's API for PyTorch trainers.

Same ``trainer_init`` / ``send_weights`` / ``shutdown`` (the round protocol is in
``weightwire.trainer.engine``), over a torch ``WeightSource`` such as
``ModuleSource``. Every trainer rank calls ``send_weights``: rank 0 sends, the
others iterate the source so their FSDP ``full_tensor()`` gathers match rank 0's.

Bytes: a tensor is flattened and viewed as ``uint8`` before it meets numpy or cupy,
because neither has a bfloat16 / float8 dtype; the view reinterprets, never converts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from weightwire.torch_side.dtypes import wire_name
from weightwire.trainer.engine import TrainerEngine
from weightwire.trainer.pipelines import DevicePacker


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a tensor's C-order bytes (a copy only if non-contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


class TorchTrainerEngine(TrainerEngine):
    """Trainer engine over a ``WeightSource`` yielding torch tensors."""

    def describe(self, tensor: Any) -> tuple[str, tuple[int, ...]]:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"source yielded {type(tensor).__name__}, expected torch.Tensor")
        return wire_name(tensor.dtype), tuple(tensor.shape)

    def host_bytes(self, tensor: Any) -> np.ndarray:
        return tensor_bytes(tensor).cpu().numpy()

    def device_packer(self, device: int | None) -> DevicePacker:
        return TorchDevicePacker(device)


class TorchDevicePacker(DevicePacker):
    """Gathers torch tensors into the slot's reusable buffer, on torch-created streams
    handed to NCCL as CuPy streams.

    Each stream first waits on the caller's current stream, so packing reads the
    weights the trainer last wrote. Staging copies (another device, non-contiguous)
    are made on the slot's stream and held by the pipeline until that stream is
    synchronized, so the caching allocator cannot recycle them under the copy.
    """

    def __init__(self, device: int | None) -> None:
        import cupy  # noqa: PLC0415  (GPU hosts only)

        from weightwire.backends.nccl.buffers import SlotBuffers  # noqa: PLC0415

        if not torch.cuda.is_available():
            raise RuntimeError("the NCCL path needs CUDA tensors: torch sees no GPU")
        self._cupy = cupy
        index = torch.cuda.current_device() if device is None else device
        self._device = torch.device("cuda", index)
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._buffers = SlotBuffers(cupy, index)

    def new_stream(self) -> Any:
        stream = torch.cuda.Stream(device=self._device)
        self._streams[stream.cuda_stream] = stream
        return self._cupy.cuda.ExternalStream(stream.cuda_stream, self._device.index)

    def _flats(self, tensors: Sequence[Any], stream: Any) -> list[torch.Tensor]:
        torch_stream = self._streams[stream.ptr]
        torch_stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(torch_stream):
            return [tensor_bytes(t.to(self._device, non_blocking=True)) for t in tensors]

    def pack(self, tensors: Sequence[Any], nbytes: int, stream: Any, slot: int) -> Any:
        from weightwire.backends.nccl.buffers import tensor_device_bytes  # noqa: PLC0415

        return self._buffers.gather(slot, [tensor_device_bytes(f) for f in self._flats(tensors, stream)], nbytes, stream)

    def wire(self, tensor: Any, stream: Any) -> Any:
        from weightwire.backends.nccl.buffers import tensor_device_bytes  # noqa: PLC0415

        # A raw pointer, not DLPack: the slot's stream already waits on the trainer's
        # stream (``_flats``), and a DLPack import costs ~0.2 ms per tensor.
        (flat,) = self._flats([tensor], stream)
        return tensor_device_bytes(flat)

    def regions(self, tensors: Sequence[Any], stream: Any) -> list[Any]:
        from weightwire.backends.nccl.buffers import DeviceBytes, tensor_device_bytes  # noqa: PLC0415

        # Contiguous tensors already on this device are read in place (a raw pointer: the
        # per-tensor work is on a small model's critical path); the rest go through
        # ``_flats`` (staging copies on the stream). Either way the stream first waits
        # on the trainer's current stream.
        torch_stream = self._streams[stream.ptr]
        torch_stream.wait_stream(torch.cuda.current_stream(self._device))
        out: list[Any] = []
        for t in tensors:
            if t.is_cuda and t.device == self._device and t.is_contiguous():
                out.append(DeviceBytes(t.data_ptr(), t.numel() * t.element_size(), self._device.index, t))
            else:
                out.append(tensor_device_bytes(self._flats([t], stream)[0]))
        return out

    def settled(self, slot: int) -> None:
        self._buffers.settled(slot)

    def release(self) -> None:
        self._buffers.release()
