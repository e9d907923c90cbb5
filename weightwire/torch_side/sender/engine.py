"""``TorchTrainerEngine``: the JAX engine's API for PyTorch trainers.

Same ``trainer_init`` / ``send_weights`` / ``shutdown`` (the round protocol is in
``weightwire.trainer.engine``), over a torch ``WeightSource`` such as
``ModuleSource``. Every trainer rank calls ``send_weights``: rank 0 sends, the
others iterate the source so their FSDP ``full_tensor()`` gathers match rank 0's.

Bytes: a tensor is flattened and viewed as ``uint8`` before it meets numpy or cupy,
because neither has a bfloat16 / float8 dtype; the view reinterprets, never converts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from weightwire.backends.base import DevicePacker, LocalShards
from weightwire.backends.device import DeviceBytes, tensor_device_bytes
from weightwire.shared.meta import ParamMeta
from weightwire.shared.slices import Box
from weightwire.shared.source import WeightSource
from weightwire.torch_side.dtypes import wire_name
from weightwire.torch_side.sender.cow import CowSnapshots
from weightwire.torch_side.sender.delta import TorchDeltaKernel
from weightwire.torch_side.sender.snapshot import (
    CopySnapshots,
    RoundStreams,
    live,
    source_tensor,
)
from weightwire.trainer.delta import DeltaKernel
from weightwire.trainer.engine import TrainerEngine
from weightwire.trainer.framework import refuse_other_framework
from weightwire.trainer.slice_plan import Holdings
from weightwire.trainer.snapshot import Snapshot

_NUMPY_NATIVE = frozenset(
    (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
    + (torch.float16, torch.float32, torch.float64)
)
"""Dtypes ``Tensor.numpy()`` takes as they are (no bfloat16 nor float8 in numpy)."""


def host_array(tensor: torch.Tensor) -> np.ndarray:
    """A flat ``uint8`` array of a tensor's C-order bytes on the host: a contiguous CPU
    tensor of a dtype numpy has is read through its own ``numpy()`` (the array holds the
    tensor itself), where ``tensor_bytes`` makes a ``uint8`` tensor view the array holds:
    one more GC-tracked object per tensor while its chunk is sent, hundreds in a delta
    round, which its young collections promoted towards a full one (#49)."""
    if (
        tensor.device.type == "cpu"
        and tensor.dtype in _NUMPY_NATIVE
        and tensor.is_contiguous()
        and not tensor.requires_grad
        and not tensor.is_conj()
        and not tensor.is_neg()
    ):
        return tensor.numpy().reshape(-1).view(np.uint8)
    return tensor_bytes(tensor).cpu().numpy()


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of a tensor's C-order bytes (a copy only if non-contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


class TorchTrainerEngine(TrainerEngine):
    """Trainer engine over a ``WeightSource`` yielding torch tensors."""

    _copies: CopySnapshots | None = None
    _cows: CowSnapshots | None = None
    _streams: RoundStreams | None = None
    framework = "torch"

    def before_update(self, params: Any = None) -> None:
        """Call before writing the parameters in place outside a torch optimizer's ``step``
        while an overlapped round with ``snapshot="cow"`` may be in flight: the tensors the
        round has not read yet are copied first (``params``: the ones about to be written,
        default all), and the call waits while the round may still be reading one. A no-op
        in the other snapshot modes or with no round in flight."""
        if self._cows is not None:
            self._cows.protect(None if params is None else list(params))

    @property
    def snapshot_bytes(self) -> int:
        """Trainer memory the overlapped rounds' snapshots hold now (``copy``: the buffer
        sets; ``cow``: the copies made before writes)."""
        held = self._cows.stats.held if self._cows is not None else 0
        return held + (self._copies.nbytes if self._copies is not None else 0)

    @property
    def snapshot_peak_bytes(self) -> int:
        """The most trainer memory the snapshots held at once (``copy``: its buffer sets,
        kept for reuse; ``cow``: the most copies held at once)."""
        peak = self._cows.stats.peak if self._cows is not None else 0
        return peak + (self._copies.nbytes if self._copies is not None else 0)

    def _cow_snapshots(self) -> CowSnapshots:
        if self._cows is None:
            self._cows = CowSnapshots(self.info.timeouts.round_s, self._round_streams())
        return self._cows

    def _round_streams(self) -> RoundStreams:
        if self._streams is None:
            self._streams = RoundStreams(self.info.timeouts.transfer_s)
        return self._streams

    def describe(self, tensor: Any) -> tuple[str, tuple[int, ...]]:
        if not isinstance(tensor, torch.Tensor):
            refuse_other_framework(type(self).__name__, self.framework, tensor, "source's tensor")
        source_tensor(tensor)  # a meta tensor is refused here, before its chunk is packed
        return wire_name(tensor.dtype), tuple(tensor.shape)

    def host_bytes(self, tensor: Any) -> np.ndarray:
        return host_array(tensor)

    def process_rank(self) -> int:
        dist = torch.distributed
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def process_count(self) -> int:
        dist = torch.distributed
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def slice_holdings(self, tensors: Mapping[str, Any]) -> Holdings:
        """A DTensor's boxes per rank from its mesh and placements, a plain tensor whole on
        this process (``torch_side.sender.holdings``: no data moves)."""
        from weightwire.torch_side.sender.holdings import holdings_of

        return holdings_of(dict(tensors), rank=self.process_rank())

    def local_shards(self, tensors: Mapping[str, Any], device: int | None) -> LocalShards:
        """One trainer rank: the device holding every plain tensor whole
        (``holdings.TorchLocalShards``; a DTensor is refused by name)."""
        from weightwire.torch_side.sender.holdings import TorchLocalShards

        return TorchLocalShards.of(tensors, device)

    def read_box(self, tensor: Any, box: Box) -> np.ndarray:
        """A view of the box in this process's tensor (a DTensor's local shard), copied
        to the host: nothing is gathered."""
        from weightwire.torch_side.sender.holdings import local_piece

        piece = local_piece(tensor, box, rank=self.process_rank())
        return tensor_bytes(piece).cpu().numpy()

    def cut_box(self, tensor: Any, box: Box) -> Any:
        """The box of this process's tensor (a DTensor's local shard), contiguous on its
        device: nothing is gathered, nothing goes through the host."""
        from weightwire.torch_side.sender.holdings import local_piece

        return local_piece(tensor, box, rank=self.process_rank()).contiguous()

    def delta_kernel(self) -> DeltaKernel:
        return TorchDeltaKernel()

    def flat_index(self, n: int, like: Any) -> Any:
        return torch.arange(n, dtype=torch.int32, device=like.device)

    def device_packer(self, device: int | None) -> DevicePacker:
        return TorchDevicePacker(device)

    def snapshot(self, source: WeightSource, metas: list[ParamMeta] | None = None) -> Snapshot:
        """``snapshot="copy"``: every tensor copied into this engine's reusable buffers;
        ``"cow"``: the live tensors, a tensor copied only before a write the round has not
        read yet (``sender.cow``); ``"none"``: the source itself (see
        ``TrainerInitInfo.snapshot``)."""
        if self.info.snapshot == "none":
            return live(source, self._round_streams())
        if self.info.snapshot == "cow":
            return self._cow_snapshots().take(source, metas)
        if self._copies is None:
            self._copies = CopySnapshots(self._round_streams())
        return self._copies.take(source, metas)


class TorchDevicePacker(DevicePacker):
    """Resolves torch tensors to their device bytes on torch-created streams handed to
    the backend as CuPy streams (what it does with the bytes is the backend's).

    Each stream first waits on the caller's current stream, so packing reads the
    weights the trainer last wrote. Staging copies (another device, non-contiguous)
    are made on the slot's stream and kept alive by their ``DeviceBytes`` (held by the
    backend's data path) until that stream is synchronized, so the caching
    allocator cannot recycle them under the copy.
    """

    def __init__(self, device: int | None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("the NCCL path needs CUDA tensors: torch sees no GPU")
        index = torch.cuda.current_device() if device is None else device
        self._device = torch.device("cuda", index)
        self._streams: dict[int, torch.cuda.Stream] = {}
        import cupy  # GPU hosts only

        self._cupy = cupy
        self.ordinal = index

    def new_stream(self) -> Any:
        stream = torch.cuda.Stream(device=self._device)
        self._streams[stream.cuda_stream] = stream
        return self._cupy.cuda.ExternalStream(stream.cuda_stream, self._device.index)

    def regions(self, tensors: Sequence[Any], stream: Any) -> list[Any]:
        # Contiguous tensors already on this device are read in place: a raw pointer, not
        # DLPack (~0.2 ms per tensor, on a small model's critical path); the stream already
        # waits on the trainer's. The rest get a staging copy on the stream.
        torch_stream = self._streams[stream.ptr]
        torch_stream.wait_stream(torch.cuda.current_stream(self._device))
        out: list[Any] = []
        index = self._device.index  # per tensor, per round: an int compare, not a torch.device one
        for t in tensors:
            if t.is_cuda and t.get_device() == index and t.is_contiguous():
                out.append(DeviceBytes(t.data_ptr(), t.nbytes, index, t))
            else:
                with torch.cuda.stream(torch_stream):
                    out.append(
                        tensor_device_bytes(tensor_bytes(t.to(self._device, non_blocking=True)))
                    )
        return out
