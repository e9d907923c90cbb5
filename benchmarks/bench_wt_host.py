"""Host cost of a written-through round's enqueue path on CPU, for the 0.5B and 8B tables.

    python benchmarks/bench_wt_host.py [--models qwen2-0.5b,llama3-8b] [--rounds 200]
        [--start-ms 1.0] [--profile] [--go-accepts]

The trainer's real ``IPCWriteThroughPipeline`` (``weightwire_ipc`` write-through) sends the
model's Hugging Face tensors (``tools.bench.sync_models``: names, shapes, bf16) into a landing
table laid out as vLLM lays out Llama (q / k / v rows of a fused ``qkv_proj``, gate / up of a
fused ``gate_up_proj``, the rest each in its own parameter; Qwen2-0.5B's head tied, so not
sent), 1 GiB chunks (the default packed buffer), over a real control channel to a scripted
worker that answers each round's start with its ``go`` at once. CUDA is a fake that only
counts: what is timed is the host's Python work, which on a GPU host sits between the
start's answer and the first write, and under every chunk.

Two numbers per model (medians over ``--rounds`` after a warm-up):

Each model runs twice: the same source buffers every round (a torch trainer's parameters,
updated in place: the gather tables are reused) and new ones every round (a JAX trainer's
step makes new arrays: every chunk's table is built and uploaded again).

- ``round``: the whole ``send`` with a start that answers at once: the enqueue path's host
  cost of a round (regions, each chunk's copy plan, table builds and uploads, launches,
  events, the ``go`` / ``done`` messages);
- ``first write``: with a start that answers after ``--start-ms`` (its ``go`` sent at once,
  as a worker sends it from inside its start), when the first write into the parameters
  was enqueued, counted from the start's answer (negative: before it) and from the go.

``--profile`` prints a cProfile of the ``round`` runs (its top entries by own time);
``--go-accepts``: the round's gos accept it (``Outgoing.go_accepts``: one server whose start
pauses first), so the first write goes at the go instead of at the start's answer.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import socket
import statistics
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from weightwire.backends.base import Outgoing
from weightwire.backends.device import DeviceBytes
from weightwire.backends.ipc.channel import Channel
from weightwire.backends.ipc.link import IPCSenderComm
from weightwire.backends.ipc.slots import IPCSlots
from weightwire.backends.ipc.through.pipeline import IPCWriteThroughPipeline
from weightwire.backends.ipc.through.table import (
    Alloc,
    Land,
    LandingTable,
    ParamSlot,
    TensorLands,
    table_messages,
)
from weightwire.shared.framing import plan
from weightwire.shared.meta import ParamMeta
from weightwire.tools.bench.sync_models import MODELS, hf_shapes

PARAMS_AT = 1 << 44
"""Where the fake parameter allocation is mapped: a write is a copy whose destination is here."""
SOURCES_AT = 1 << 40
CHUNK = 1 << 30


class _Clock:
    """When the first write into the parameters was enqueued (``perf_counter``)."""

    def __init__(self) -> None:
        self.first: float | None = None
        self.launches = 0

    def wrote(self, dst: int) -> None:
        self.launches += 1
        if self.first is None and dst >= PARAMS_AT:
            self.first = time.perf_counter()


class _Dev:
    def __init__(self, n: int) -> None:
        self.buf = np.empty(max(1, n), dtype=np.uint64)
        self.data = type("P", (), {"ptr": PARAMS_AT - (1 << 36)})()  # a device table: not a param


class _Kernel:
    def __init__(self, clock: _Clock) -> None:
        self.clock = clock

    def compile(self) -> None:
        pass

    def __call__(self, grid: Any, block: Any, args: tuple[Any, ...], stream: Any = None) -> None:
        self.clock.wrote(PARAMS_AT)  # every kernel here writes into the parameters


class _Runtime:
    CUDARuntimeError = RuntimeError

    def __init__(self, clock: _Clock) -> None:
        self.clock, self._next = clock, 1000

    def _new(self) -> int:
        self._next += 1
        return self._next

    def eventCreateWithFlags(self, flags: int) -> int:
        return self._new()

    def eventRecord(self, event: int, stream: int) -> None:
        pass

    def eventQuery(self, event: int) -> int:
        return 0

    def eventDestroy(self, event: int) -> None:
        pass

    def streamWaitEvent(self, stream: int, event: int, flags: int) -> None:
        pass

    def memcpyAsync(self, dst: int, src: int, n: int, kind: int, stream: int) -> None:
        if kind == 3:  # device to device: a copy of the round's bytes
            self.clock.wrote(dst)

    def malloc(self, n: int) -> int:
        return self._new() << 20

    def free(self, ptr: int) -> None:
        pass

    def ipcOpenMemHandle(self, handle: bytes, flags: int) -> int:
        return PARAMS_AT

    def ipcCloseMemHandle(self, ptr: int) -> None:
        pass

    def getDeviceProperties(self, i: int) -> dict[str, Any]:
        return {"uuid": b"\x01" * 16}


class _Event:
    done = True

    def __init__(self, **_: Any) -> None:
        pass

    def record(self, stream: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class FakeCupy:
    """The CuPy surface the write-through pipeline touches, counting writes only."""

    int64 = np.int64
    uint64 = np.uint64

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock
        cuda = type("cuda", (), {})()
        cuda.runtime = _Runtime(clock)
        cuda.Device = lambda i: nullcontext()
        cuda.Event = _Event
        cuda.ExternalStream = lambda ptr, dev=None: ptr
        cuda.alloc_pinned_memory = lambda n: bytearray(n)
        self.cuda = cuda

    def RawKernel(self, source: str, name: str) -> _Kernel:
        return _Kernel(self.clock)

    def empty(self, n: int, dtype: Any = None) -> _Dev:
        return _Dev(n)

    def zeros(self, n: int, dtype: Any = None) -> _Dev:
        return _Dev(n)

    def asarray(self, values: Any) -> _Dev:
        return _Dev(np.asarray(values).size)


class _Packer:
    def new_stream(self) -> Any:
        return type("S", (), {"ptr": 7})()

    def regions(self, tensors: list[tuple[int, int]], stream: Any) -> list[DeviceBytes]:
        return [DeviceBytes(ptr, n, 0, None) for ptr, n in tensors]

    def release(self) -> None:
        pass


def vllm_table(model: str) -> tuple[list[ParamMeta], LandingTable]:
    """The model's HF tensors (bf16) and where vLLM's Llama puts each: fused q / k / v and
    gate / up rows, everything else a parameter of its own, one allocation."""
    metas = [ParamMeta(n, "bfloat16", tuple(s)) for n, s in hf_shapes(MODELS[model])]
    params: list[ParamSlot] = []
    index: dict[str, tuple[int, int]] = {}  # fused parameter -> (param, rows so far)
    lands: list[TensorLands] = []
    offset = 0

    def param(name: str, numel: int) -> int:
        nonlocal offset
        params.append(ParamSlot(name, 0, offset, 2 * numel, "bfloat16"))
        offset += 2 * numel + 256 - (2 * numel) % 256
        return len(params) - 1

    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
    fused.update(gate_proj="gate_up_proj", up_proj="gate_up_proj")
    layer_rows: dict[str, int] = {}
    for m in metas:
        numel = int(np.prod(m.shape))
        parts = m.name.split(".")
        target = next((fused[p] for p in parts if p in fused), None)
        strides = tuple(int(np.prod(m.shape[k + 1 :])) for k in range(len(m.shape)))
        if target is None:
            p = param(m.name, numel)
            lands.append(TensorLands(m.name, (Land(p, m.shape, 0, strides, 0, strides),)))
            continue
        key = ".".join(parts[:-3] + [target, parts[-1]])  # model.layers.i.<mod>.<fused>.weight
        if key not in index:
            c = MODELS[model]
            width = m.shape[1] if len(m.shape) == 2 else 1
            if target == "qkv_proj":
                rows = (c["heads"] + 2 * c["kv"]) * c["head_dim"]
            else:
                rows = 2 * c["inter"]
            index[key] = (param(key, rows * width), 0)
        p, done = index[key]
        width = m.shape[1] if len(m.shape) == 2 else 1
        lands.append(TensorLands(m.name, (Land(p, m.shape, 0, strides, done * width, strides),)))
        index[key] = (p, done + m.shape[0])
        layer_rows[key] = done + m.shape[0]
    table = LandingTable((Alloc(b"\x07" * 64, offset),), tuple(params), tuple(lands))
    return metas, table


class _Worker(threading.Thread):
    """Offers the table once; then each round: ``go`` as soon as the start arrives, ``done``."""

    def __init__(self, conn: socket.socket, table: LandingTable) -> None:
        super().__init__(daemon=True)
        self.ch, self.table = Channel(conn, "trainer"), table
        self.started = threading.Semaphore(0)
        self.stop = False
        self.went = 0.0  # when this round's go was sent

    def run(self) -> None:
        offered = False
        while True:
            if not self.started.acquire(timeout=30) or self.stop:
                return
            deadline = time.monotonic() + 30
            if not offered:
                for msg in table_messages(self.table, 0):
                    self.ch.send(msg)
                self.ch.expect("path", deadline=deadline, what="path")
                self.ch.send({"op": "go", "t": 0})
                offered = True
            else:
                self.went = time.perf_counter()
                self.ch.send({"op": "go", "t": 0, "early": True})
            self.ch.expect("done", deadline=deadline, what="done")


def measure(
    model: str,
    rounds: int,
    start_s: float,
    profile: bool,
    moving: bool,
    go_accepts: bool = False,
) -> dict[str, float]:
    metas, table = vllm_table(model)
    clock = _Clock()
    cp = FakeCupy(clock)
    slots = IPCSlots(cp, 0, CHUNK, 2)
    slots.free_memory()
    a, b = socket.socketpair()
    comm = IPCSenderComm(
        cp, slots, [Channel(a, "IPC worker rank 1")], [[11, 12]], [""], False, "write_through"
    )
    worker = _Worker(b, table)
    worker.start()
    pipe = IPCWriteThroughPipeline(comm, _Packer(), timeout=30.0)
    chunks = plan(metas, packed=True, buffer_size_bytes=CHUNK)
    sources: list[tuple[int, int]] = []
    at = SOURCES_AT
    for m in metas:
        n = 2 * int(np.prod(m.shape))
        sources.append((at, n))
        at += n + 256 - n % 256
    turn = [0]

    def one(delay: float) -> tuple[float, float, float]:
        tensors = sources
        if moving:  # a JAX step's new arrays: buffers never seen before
            turn[0] += 1
            tensors = [(ptr + (turn[0] << 36), n) for ptr, n in sources]
        answered: list[float] = []

        def begin() -> None:
            worker.started.release()  # the start reaches the worker: its go goes out
            if delay:
                time.sleep(delay)
            answered.append(time.perf_counter())

        prepared = [(c, tensors[c.start : c.stop]) for c in chunks]
        clock.first = None
        began = time.perf_counter()
        # one server whose start pauses first: its workers' gos accept the round (an older
        # tree has no such field: left out unless asked)
        accepts = {"go_accepts": True} if go_accepts else {}
        pipe.send(Outgoing(prepared, threading.Event(), begin=begin, metas=metas, **accepts))
        took = time.perf_counter() - began
        assert clock.first is not None
        return took, clock.first - answered[0], clock.first - worker.went

    for _ in range(5):
        one(0.0)
    prof = cProfile.Profile() if profile else None
    if prof is not None:
        prof.enable()
    whole = [one(0.0)[0] for _ in range(rounds)]
    if prof is not None:
        prof.disable()
        print(f"--- {model}: cProfile of {rounds} rounds (own time)")
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    lagged = [one(start_s) for _ in range(max(10, rounds // 4))]
    worker.stop = True
    worker.started.release()
    pipe.close()
    return {
        "tensors": len(metas),
        "chunks": len(chunks),
        "round_ms": 1e3 * statistics.median(whole),
        "first_write_after_answer_ms": 1e3 * statistics.median(x[1] for x in lagged),
        "first_write_after_go_ms": 1e3 * statistics.median(x[2] for x in lagged),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="qwen2-0.5b,llama3-8b")
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--start-ms", type=float, default=1.0)
    p.add_argument("--profile", action="store_true")
    p.add_argument(
        "--go-accepts",
        action="store_true",
        help="the round's workers' gos accept it (one server whose start pauses first): the "
        "first write goes at the go, not at the start's answer",
    )
    args = p.parse_args(argv)
    for model in args.models.split(","):
        for moving in (False, True):
            r = measure(
                model, args.rounds, args.start_ms / 1e3, args.profile, moving, args.go_accepts
            )
            print(
                f"{model} ({'new' if moving else 'the same'} source buffers each round): "
                f"{r['tensors']} tensors, {r['chunks']} chunks; round (enqueue path, start "
                f"answered at once) {r['round_ms']:.3f} ms; first write "
                f"{r['first_write_after_answer_ms']:+.3f} ms after the start's answer "
                f"(start {args.start_ms:g} ms), {r['first_write_after_go_ms']:+.3f} ms after "
                "the go"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
