"""The torch quantizer's block weights on the fused CUDA kernel (``trainer.fp8_cuda``).

``quantize_blocks`` takes a group's ``Fp8Block`` weights that sit on a CUDA device and
queues one launch per input dtype on torch's current stream: the outputs (e4m3 weight,
float32 scales, each tile's amax for the finite flag) from torch's caching allocator, the
table uploaded from pinned memory on the same stream, so nothing waits on the host. What
it does not take (no CuPy, the kernel did not compile: said once per device; the switch
``WEIGHTWIRE_FP8_KERNEL=0``; a CPU tensor) stays on ``quant``'s torch ops, with the same
bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from weightwire.shared.checks import env_switch
from weightwire.shared.quant import Fp8Block
from weightwire.torch_side.dtypes import wire_name
from weightwire.trainer import fp8_cuda
from weightwire.trainer.fp8_cuda_source import KERNELS

FUSED_TYPE = "cuda"
"""The device type the kernel takes (a CPU test runs the kernel's host build on ``cpu``)."""


class FusedBlocks(NamedTuple):
    """One weight quantized by the kernel (queued): e4m3 weight, float32 scales, amaxes."""

    weight: torch.Tensor
    scale: torch.Tensor
    amax: torch.Tensor


def enabled() -> bool:
    """``WEIGHTWIRE_FP8_KERNEL``: ``1`` (default) quantizes CUDA block weights with the fused
    kernel where it compiles, ``0`` with torch ops (the same bytes; slower)."""
    return env_switch(
        "WEIGHTWIRE_FP8_KERNEL", True, "the fused CUDA kernel where it compiles", "torch ops"
    )


def kernels_for(device: torch.device) -> Any:
    """The compiled kernels for ``device``, or None (the torch ops take its weights)."""
    return fp8_cuda.kernels(device.index if device.index is not None else 0)


def _stream(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return int(torch.cuda.current_stream(device).cuda_stream)


def _upload(table: Any, device: torch.device) -> torch.Tensor:
    host = torch.from_numpy(table)
    if device.type != "cuda":
        return host
    # pinned: the copy is queued on the current stream, and torch's host allocator keeps
    # the pinned block until it ran
    return host.pin_memory().to(device, non_blocking=True)


def quantize_blocks(items: Sequence[tuple[int, torch.Tensor, Fp8Block]]) -> dict[int, FusedBlocks]:
    """Queue the kernel over the ``(position, weight, scheme)`` it can take; returns them by
    position. The others (empty dict: all) are the caller's."""
    if not items or not enabled():
        return {}
    by_device: dict[torch.device, list[tuple[int, torch.Tensor, Fp8Block]]] = {}
    for position, x, scheme in items:
        if x.device.type == FUSED_TYPE and wire_name(x.dtype) in KERNELS:
            by_device.setdefault(x.device, []).append((position, x, scheme))
    done: dict[int, FusedBlocks] = {}
    for device, members in by_device.items():
        kernels = kernels_for(device)
        if kernels is not None:
            done.update(_launch(kernels, device, members))
    return done


def _launch(
    kernels: Any, device: torch.device, members: list[tuple[int, torch.Tensor, Fp8Block]]
) -> dict[int, FusedBlocks]:
    tiles = [-(-x.shape[0] // s.block[0]) * -(-x.shape[1] // s.block[1]) for _, x, s in members]
    # one amax buffer for the group: the caller's finite check is one op over all of it
    amaxes = torch.empty(sum(tiles), dtype=torch.float32, device=device)
    done: dict[int, FusedBlocks] = {}
    jobs: dict[str, list[fp8_cuda.BlockJob]] = {}
    keep = []
    at = 0
    for (position, x, scheme), count in zip(members, tiles, strict=True):
        m, n = x.shape
        if x.stride(1) != 1 or (m > 1 and x.stride(0) < n):
            x = x.contiguous()  # rows of unit stride: a transposed view is copied once
        ld = x.stride(0) if m > 1 else n
        rows, cols = -(-m // scheme.block[0]), -(-n // scheme.block[1])
        weight = torch.empty((m, n), dtype=torch.float8_e4m3fn, device=device)
        scale = torch.empty((rows, cols), dtype=torch.float32, device=device)
        amax = amaxes[at : at + count].view(rows, cols)
        at += count
        dtype = wire_name(x.dtype)
        jobs.setdefault(dtype, []).append(
            fp8_cuda.BlockJob(
                x.data_ptr(), weight.data_ptr(), scale.data_ptr(), amax.data_ptr(), m, n, ld,
                dtype, scheme.block, scheme.ue8m0,
            )
        )  # fmt: skip
        keep.append(x)
        done[position] = FusedBlocks(weight, scale, amax)
    stream = _stream(device)
    for dtype, group in jobs.items():
        table, count = fp8_cuda.block_table(group)
        on_device = _upload(table, device)
        kernels.launch(dtype, on_device.data_ptr(), len(group), count, stream)
    # stream order keeps ``keep`` and the table valid: the caching allocator hands their
    # memory out again only to work queued after the launch on this stream
    del keep
    return done
