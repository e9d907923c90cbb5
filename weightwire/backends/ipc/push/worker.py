"""The worker's push link of ``weightwire_ipc`` (``IPCLink``, unpacked rounds or a trainer
that chose push).

Push, per piece (the trainer's slots opened once per session): the copy stream waits (on
the device) for the slot's ready event, copies the piece into the chunk's fresh buffer,
records this worker's free event for the slot and only then says "free" to the trainer,
which refills the slot after that event. The copy-out is needed: vLLM's layerwise reload
and ``HFModelHost`` keep the tensors they are handed until their layer (round) completes,
while the slot is refilled at once. Chunks land in fresh allocations, as on the other links.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from weightwire._trace import dump_trace, trace
from weightwire.backends.ipc.channel import check_int
from weightwire.backends.ipc.info import decode_handles
from weightwire.backends.ipc.receiver import IPCReceiver, Posted, posted_chunk
from weightwire.backends.ipc.slots import (
    MEMCPY_DEVICE_TO_DEVICE,
    record,
    stream_wait,
    sync_stream,
    wait_event_host,
    wait_mode,
)
from weightwire.backends.receiving import ChunkedLink
from weightwire.backends.worker_base import ReceiveTurn
from weightwire.shared.errors import TransferError


class IPCLink(ChunkedLink):
    """Chunks arrive as pieces through the trainer's slots (see the module docstring)."""

    def __init__(
        self, communicator: IPCReceiver, *, device: torch.device, timeout_s: float, depth: int
    ) -> None:
        super().__init__(device=device, timeout_s=timeout_s, depth=depth)
        self.communicator = communicator
        self._stream = torch.cuda.Stream(device=device)
        self._pending: dict[int, Posted] = {}
        self._host_wait = wait_mode() == "host"

    def post(self, index: int, turn: ReceiveTurn) -> None:
        buf = torch.empty(turn.chunks[index].nbytes, dtype=torch.uint8, device=self.device)
        # The fresh block may have been freed by work still queued on the current stream.
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self._pending[index] = posted_chunk(buf, index, turn)

    def wait(self, index: int) -> torch.Tensor:
        posted = self._pending.pop(index)
        buf, chunk, last = posted.buffer, posted.chunk, posted.last
        rx = self.communicator
        cp, ch, sptr = rx.cp, rx.channel, self._stream.cuda_stream
        deadline = time.monotonic() + self.timeout_s
        got, base, count = 0, buf.data_ptr(), len(rx.ready)
        with cp.cuda.Device(rx.device):
            while got < chunk.nbytes:
                trace(f"wait c{index}")
                msg = ch.recv(
                    deadline=deadline, what=f"piece at byte {got} of chunk {index}", alive=rx.alive
                )
                trace(f"got {msg.get('s')}")
                if msg["op"] == "slots":
                    self._remap(msg)
                    continue
                if msg["op"] != "ready":
                    raise TransferError(
                        f"{ch.peer} sent {msg['op']!r} while chunk {index} was being received"
                    )
                if (
                    check_int(msg, "c", 0, 1 << 62, ch.peer) != index
                    or check_int(msg, "o", 0, 1 << 62, ch.peer) != got
                ):
                    raise TransferError(
                        f"{ch.peer} announced chunk {msg['c']} at byte {msg['o']} "
                        f"where chunk {index} at byte {got} "
                        "was due: trainer and worker disagree on the round's plan"
                    )
                slot = check_int(msg, "s", 0, count - 1, ch.peer)
                n = check_int(
                    msg, "n", 1, min(chunk.nbytes - got, rx.info.packed_buffer_size_bytes), ch.peer
                )
                if self._host_wait:
                    wait_event_host(
                        cp,
                        rx.ready[slot],
                        deadline=deadline,
                        what=f"the trainer's fill of IPC slot {slot}",
                        alive=rx.alive,
                    )
                else:
                    stream_wait(cp, sptr, rx.ready[slot])
                cp.cuda.runtime.memcpyAsync(
                    base + got, rx.slots.ptrs[slot], n, MEMCPY_DEVICE_TO_DEVICE, sptr
                )
                record(cp, rx.free[slot], sptr)
                ch.send({"op": "free", "s": slot})
                got += n
            if last and rx.info.release_after_round:
                # The trainer frees its slots after this round: copy-outs done, mappings closed
                # first.
                sync_stream(
                    cp,
                    rx.device,
                    sptr,
                    timeout=self.timeout_s,
                    what="the IPC copy-out",
                    alive=rx.alive,
                )
                rx.slots.close()
                ch.send({"op": "closed"})
        buf.record_stream(self._stream)
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        if last:
            dump_trace("worker")
        return buf

    def _remap(self, msg: dict[str, Any]) -> None:
        rx = self.communicator
        handles = decode_handles(f"{rx.channel.peer} slots.mem", msg.get("mem"))
        if len(handles) != len(rx.ready):
            raise TransferError(
                f"{rx.channel.peer} announced {len(handles)} slots, the session has {len(rx.ready)}"
            )
        rx.slots.open(handles)

    def _settle(self, timeout: float) -> bool:
        rx = self.communicator
        try:
            sync_stream(
                rx.cp,
                rx.device,
                self._stream.cuda_stream,
                timeout=timeout,
                what="the IPC copy stream",
            )
        except Exception:
            return False
        return True

    def abort(self) -> None:
        self._pending.clear()
        self.communicator.abort()
        # Unmap once no copy-out reads the slots any more (bounded); a copy stream
        # that will not settle keeps its mappings rather than read unmapped memory.
        if self._settle(5.0):
            self.communicator.close()

    def close(self) -> None:
        self._pending.clear()
        if self._settle(30.0):
            self.communicator.close()
        else:
            self.communicator.abort()
