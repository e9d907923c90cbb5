"""The worker's end of ``weightwire_ipc``: connect (open the trainer's slots once per
session) and ``IPCLink`` (copy each piece out of its slot into the chunk's buffer).

Per piece: the copy stream waits (on the device) for the slot's ready event, copies
the piece into the chunk's fresh buffer, records this worker's free event for the
slot and only then says "free" to the trainer, which refills the slot after that
event. The copy-out is needed: vLLM's layerwise reload and ``HFModelHost`` keep the
tensors they are handed until their layer (round) completes, while the slot is
refilled at once. Chunks land in fresh allocations, as on the other links.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import suppress
from typing import Any

import torch

from weightwire.backends.ipc.channel import Channel, check_int, dial
from weightwire.backends.ipc.slots import (
    MEMCPY_DEVICE_TO_DEVICE,
    OpenedSlots,
    cupy_module,
    device_uuid,
    dump_trace,
    event_handle,
    new_ipc_event,
    open_event,
    record,
    stream_wait,
    sync_stream,
    trace,
    wait_event_host,
    wait_mode,
)
from weightwire.shared.communicator import TransferError
from weightwire.shared.framing import Chunk
from weightwire.shared.info import encode_secret
from weightwire.shared.ipc_info import IPCInitInfo, decode_handles
from weightwire.shared.meta import ParamMeta
from weightwire.shared.timeouts import Timeouts
from weightwire.torch_side.worker.receive import ReceiveLink


class IPCReceiver:
    """A worker's session: channel, opened slots and ready events, its own free events."""

    def __init__(self, cp: Any, device: int, channel: Channel, slots: OpenedSlots, ready: list[int],
                 free: list[int], info: IPCInitInfo) -> None:
        self.cp, self.device, self.channel, self.slots = cp, device, channel, slots
        self.ready, self.free, self.info = ready, free, info
        self._state = "open"

    @property
    def same_gpu(self) -> bool:
        return bool(self.info.device_uuid) and self.info.device_uuid == device_uuid(self.cp, self.device)

    def alive(self) -> None:
        if self._state != "open":
            raise TransferError(f"IPC receive link is {self._state}; call init_weight_transfer_engine again")

    def warmup(self, *, timeout: float) -> None:
        self.channel.expect("ping", deadline=time.monotonic() + timeout, what="the trainer's warm-up", alive=self.alive)
        self.channel.send({"op": "pong"})

    def abort(self) -> None:
        if self._state == "open":
            self._state = "aborted"
        self.channel.abort()
        # Mappings stay until close: a copy-out may still be reading them.

    def close(self) -> None:
        if self._state == "closed":
            return
        self._state = "closed"
        self.channel.close()
        self.slots.close()
        for e in self.free:
            with suppress(Exception):
                self.cp.cuda.runtime.eventDestroy(e)
        self.free = []


def connect_ipc(info: IPCInitInfo, *, rank: int, device: torch.device) -> ReceiveLink:
    """Open the trainer's slots and ready events, dial its channel, say hello, warm up."""
    if device.type != "cuda":
        raise ValueError(f"weightwire_ipc needs a CUDA worker device, got {device}")
    cp = cupy_module()
    index = device.index if device.index is not None else torch.cuda.current_device()
    local = Timeouts.from_env()
    with cp.cuda.Device(index):
        slots = OpenedSlots(cp, index, info.mem_handles)
        ready: list[int] = []
        free: list[int] = []
        try:
            ready = [open_event(cp, h, f"the trainer's ready event {s}") for s, h in enumerate(info.event_handles)]
            free = [new_ipc_event(cp) for _ in range(info.packed_num_buffers)]
            hello = {"op": "hello", "rank": rank, "free": [encode_secret(event_handle(cp, e)) for e in free],
                     "uuid": device_uuid(cp, index)}
        except BaseException:
            slots.close()
            raise
    try:
        channel = dial(info.host, info.port, info.secret, timeout=local.connect_s,
                       peer=f"the IPC trainer at {info.host}:{info.port}")
    except BaseException:
        slots.close()
        raise
    receiver = IPCReceiver(cp, index, channel, slots, ready, free, info)
    try:
        receiver.channel.send(hello)
        receiver.warmup(timeout=local.warmup_s)
    except BaseException:
        receiver.abort()
        receiver.close()
        raise
    return IPCLink(receiver, device=torch.device("cuda", index), timeout_s=info.timeout_s, depth=info.packed_num_buffers)


class IPCLink(ReceiveLink):
    """Chunks arrive as pieces through the trainer's slots (see the module docstring)."""

    def __init__(self, communicator: IPCReceiver, *, device: torch.device, timeout_s: float, depth: int) -> None:
        super().__init__(communicator, device=device, timeout_s=timeout_s, depth=depth)
        self._stream = torch.cuda.Stream(device=device)
        self._pending: dict[int, tuple[torch.Tensor, Chunk, bool]] = {}
        self._host_wait = wait_mode() == "host"

    def post(self, index: int, chunk: Chunk, metas: Sequence[ParamMeta], *, packed: bool) -> None:
        buf = torch.empty(chunk.nbytes, dtype=torch.uint8, device=self.device)
        # The fresh block may have been freed by work still queued on the current stream.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self._pending[index] = (buf, chunk, chunk.stop == len(metas))

    def wait(self, index: int) -> torch.Tensor:
        buf, chunk, last = self._pending.pop(index)
        rx: IPCReceiver = self.communicator
        cp, ch, sptr = rx.cp, rx.channel, self._stream.cuda_stream
        deadline = time.monotonic() + self.timeout_s
        got, base, count = 0, buf.data_ptr(), len(rx.ready)
        with cp.cuda.Device(rx.device):
            while got < chunk.nbytes:
                trace(f"wait c{index}")
                msg = ch.recv(deadline=deadline, what=f"piece at byte {got} of chunk {index}", alive=rx.alive)
                trace(f"got {msg.get('s')}")
                if msg["op"] == "slots":
                    self._remap(msg)
                    continue
                if msg["op"] != "ready":
                    raise TransferError(f"{ch.peer} sent {msg['op']!r} while chunk {index} was being received")
                if check_int(msg, "c", 0, 1 << 62, ch.peer) != index or check_int(msg, "o", 0, 1 << 62, ch.peer) != got:
                    raise TransferError(
                        f"{ch.peer} announced chunk {msg['c']} at byte {msg['o']} where chunk {index} at byte {got} "
                        "was due: trainer and worker disagree on the round's plan"
                    )
                slot = check_int(msg, "s", 0, count - 1, ch.peer)
                n = check_int(msg, "n", 1, min(chunk.nbytes - got, rx.info.packed_buffer_size_bytes), ch.peer)
                if self._host_wait:
                    wait_event_host(cp, rx.ready[slot], deadline=deadline, what=f"the trainer's fill of IPC slot {slot}",
                                    alive=rx.alive)
                else:
                    stream_wait(cp, sptr, rx.ready[slot])
                cp.cuda.runtime.memcpyAsync(base + got, rx.slots.ptrs[slot], n, MEMCPY_DEVICE_TO_DEVICE, sptr)
                record(cp, rx.free[slot], sptr)
                ch.send({"op": "free", "s": slot})
                got += n
            if last and rx.info.release_after_round:
                # The trainer frees its slots after this round: copy-outs done, mappings closed first.
                sync_stream(cp, rx.device, sptr, timeout=self.timeout_s, what="the IPC copy-out", alive=rx.alive)
                rx.slots.close()
                ch.send({"op": "closed"})
        buf.record_stream(self._stream)
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        if last:
            dump_trace("worker")
        return buf

    def _remap(self, msg: dict[str, Any]) -> None:
        rx: IPCReceiver = self.communicator
        handles = decode_handles(f"{rx.channel.peer} slots.mem", msg.get("mem"))
        if len(handles) != len(rx.ready):
            raise TransferError(f"{rx.channel.peer} announced {len(handles)} slots, the session has {len(rx.ready)}")
        rx.slots.open(handles)

    def _settle(self, timeout: float) -> bool:
        rx: IPCReceiver = self.communicator
        try:
            sync_stream(rx.cp, rx.device, self._stream.cuda_stream, timeout=timeout, what="the IPC copy stream")
        except Exception:
            return False
        return True

    def abort(self) -> None:
        self._pending.clear()
        super().abort()
        # Unmap once no copy-out reads the slots any more (bounded); a copy stream
        # that will not settle keeps its mappings rather than read unmapped memory.
        if self._settle(5.0):
            self.communicator.close()

    def close(self) -> None:
        self._pending.clear()
        if self._settle(30.0):
            super().close()
        else:
            self.communicator.abort()
