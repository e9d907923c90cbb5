"""A minimal in-memory stand-in for the parts of CuPy that ``NCCLCommunicator`` touches.

It records every NCCL call with its arguments and never answers on its own, so a test
asserts weightwire's control flow (which calls, what is raised when NCCL hangs), not CuPy's.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

from weightwire.backends.nccl.comm import NCCLCommunicator


class FakeStream:
    def __init__(self, non_blocking: bool = False, ptr: int = 0x5000) -> None:
        self.ptr = ptr

    def __enter__(self) -> FakeStream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class FakeExternalStream(FakeStream):
    def __init__(self, ptr: int, device_id: int = -1) -> None:
        self.ptr, self.device_id = ptr, device_id


class FakeArray:
    def __init__(
        self, nbytes: int, *, ptr: int = 0xA000, device: int = 0, contiguous: bool = True
    ) -> None:
        self.nbytes, self.shape, self.strides = nbytes, (nbytes,), (1,)
        self.data = SimpleNamespace(ptr=ptr)
        self.device = SimpleNamespace(id=device)
        self.flags = SimpleNamespace(c_contiguous=contiguous)


class FakeCupy:
    """``complete`` decides whether recorded events report done (False = NCCL hangs)."""

    ndarray = FakeArray
    float32 = "float32"

    def __init__(self, *, complete: bool = True, devices: int = 2) -> None:
        self.complete = complete
        self.current_device: dict[str, int] = {}
        fake = self

        class Device:
            def __init__(self, index: int) -> None:
                self.index = index

            def use(self) -> None:
                fake.current_device[threading.current_thread().name] = self.index

            def __enter__(self) -> Device:
                return self

            def __exit__(self, *exc: object) -> None:
                return None

        class Event:
            def __init__(self, block: bool = False, disable_timing: bool = False) -> None:
                self.recorded_on = None

            def record(self, stream: FakeStream) -> None:
                self.recorded_on = stream

            @property
            def done(self) -> bool:
                return fake.complete

        runtime = SimpleNamespace(getDeviceCount=lambda: devices, getDevice=lambda: 0)
        self.cuda = SimpleNamespace(
            Device=Device,
            Event=Event,
            Stream=FakeStream,
            ExternalStream=FakeExternalStream,
            runtime=runtime,
        )

    def zeros(self, n: int, dtype: object) -> FakeArray:
        return FakeArray(4 * n, ptr=0xB000)


class FakeComm:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.async_error: Exception | None = None

    def allReduce(self, *args: object) -> None:  # CuPy's spelling
        self.calls.append(("allReduce", *args))

    def broadcast(self, *args: object) -> None:
        self.calls.append(("broadcast", *args))

    def check_async_error(self) -> None:
        if self.async_error is not None:
            raise self.async_error

    def abort(self) -> None:
        self.calls.append(("abort",))

    def destroy(self) -> None:
        self.calls.append(("destroy",))


def make_comm(
    *, complete: bool = True, rank: int = 0, world_size: int = 2
) -> tuple[NCCLCommunicator, FakeComm, FakeCupy]:
    cp, raw = FakeCupy(complete=complete), FakeComm()
    return (
        NCCLCommunicator(raw, rank=rank, world_size=world_size, device=0, cp=cp, version="2.28.9"),
        raw,
        cp,
    )


def names(raw: FakeComm) -> list[str]:
    return [c[0] for c in raw.calls]
