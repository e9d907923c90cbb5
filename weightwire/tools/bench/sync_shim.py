"""Control shim for ``bench_sync.py``: the receiver process and the sender's client.

The GPU host has no HTTP server stack, so the four weight-sync calls travel as one
JSON line each way over one kept-open local TCP connection (``ShimClient``; ``rpc``
opens a fresh one, for out-of-band calls such as an abort), to a
``Receiver`` that drives ``WeightwireNCCLEngine.standalone`` exactly as the reference
server would. It also runs the raw-NCCL baseline's receiving half and reports the
receiver's peak extra GPU memory. Loopback only; a benchmark aid, not a product API.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import socketserver
import threading
import time
from pathlib import Path
from typing import Any

# -- control shim: one JSON line each way per call, a fresh local connection per call -------------


def rpc(port: int, call: str, timeout: float, /, **args: Any) -> Any:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(_request(call, args))
        line = sock.makefile("rb").readline()
    if not line:
        raise ConnectionError(f"receiver closed the connection during {call}")
    return _result(call, line)


def _request(call: str, args: dict[str, Any]) -> bytes:
    """One call to the receiver process: a JSON line."""
    return (json.dumps({"call": call, "args": args}) + "\n").encode()


def _result(call: str, line: bytes) -> Any:
    """The receiver's reply line to ``call``: its result, or its error raised here."""
    reply = json.loads(line)
    if not reply["ok"]:
        raise RuntimeError(f"receiver {call} failed: {reply['error']}")
    return reply.get("result")


class ShimClient:
    """The four weight-sync calls (plus shutdown) forwarded to the receiver process, over
    one kept-open connection (like the reference server's pipe to its worker: no connect
    and no new server thread per call), reopened after a failure. Calls from several
    threads (the round's start and update run on helper threads) take turns."""

    def __init__(self, port: int, timeout: float) -> None:
        self.port, self.timeout = port, timeout
        self.seconds: dict[str, list[float]] = {}
        self._lock = threading.Lock()
        self._conn: tuple[socket.socket, Any] | None = None

    def _rpc(self, call: str, args: dict[str, Any]) -> Any:
        with self._lock:
            if self._conn is None:
                sock = socket.create_connection(("127.0.0.1", self.port), timeout=self.timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._conn = (sock, sock.makefile("rb"))
            sock, reader = self._conn
            try:
                sock.sendall(_request(call, args))
                line = reader.readline()
            except BaseException:
                self.close()
                raise
            if not line:
                self.close()
                raise ConnectionError(f"receiver closed the connection during {call}")
        return _result(call, line)

    def _call(self, call: str, **args: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._rpc(call, args)
        finally:
            self.seconds.setdefault(call, []).append(time.perf_counter() - start)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn[1].close()
            conn[0].close()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("init_weight_transfer_engine", init_info=init_info)

    def start_weight_update(self) -> None:
        self._call("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._call("update_weights", update_info=update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("finish_weight_update", weight_version=weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self._call("shutdown_weight_transfer_engine")

    def pause(self, mode: str = "keep") -> None:
        # The receiver serves no generation: a pause is its round trip only, as the loopback
        # shim's (a round written in place pauses, and is timed with it).
        self._call("pause", mode=mode)

    def resume(self) -> None:
        self._call("resume")

    def reset_prefix_cache(self) -> list[bool]:
        return [
            True
        ]  # the shim's worker loads into a sink or a tensor store: no KV outlives a round


class Sink:
    """Stands in for the model: counts what ``load_weights`` received."""

    def __init__(self) -> None:
        self.tensors = self.nbytes = 0

    def load_weights(self, weights: list[tuple[str, Any]]) -> set[str]:
        for _, t in weights:
            self.tensors += 1
            self.nbytes += t.numel() * t.element_size()
        return {name for name, _ in weights}


_SHIM_OPS = {
    "init_weight_transfer_engine": "init",
    "start_weight_update": "start",
    "update_weights": "update",
    "finish_weight_update": "finish",
    "shutdown_weight_transfer_engine": "shutdown",
}


class Receiver:
    """Receiver-process state behind the shim (engine calls are serialized by a lock)."""

    def __init__(self) -> None:
        import torch

        self.torch, self.device = torch, torch.device("cuda", 0)
        self.sink, self.lock = Sink(), threading.Lock()
        self.engine: Any = None  # a WeightwireNCCLEngine once initialized
        self.raw: dict[str, Any] = {}
        self.base = 0
        self.trace: dict[
            str, Any
        ] = {}  # last update's perf_counter() marks (one clock for all processes)

    def handle(self, call: str, args: dict[str, Any]) -> Any:
        if call.startswith("raw_"):
            return getattr(self, call)(**args)
        if call == "abort":
            return self.abort()
        if call == "trace":
            return dict(self.trace)
        if call in ("pause", "resume"):  # no generation runs here: nothing to hold back
            return None
        if call == "mem_reset":
            self.torch.cuda.reset_peak_memory_stats(self.device)
            self.base, self.sink.tensors, self.sink.nbytes = (
                self.torch.cuda.memory_allocated(self.device),
                0,
                0,
            )
            return None
        if call == "mem_peak":
            peak = self.torch.cuda.max_memory_allocated(self.device) - self.base
            return {"peak_extra": peak, "tensors": self.sink.tensors, "nbytes": self.sink.nbytes}
        if call.startswith("op:"):  # a worker operation by its replica name (the HTTP API process)
            return self.op(call[3:], args)
        op = _SHIM_OPS.get(call)
        if op is None:
            raise ValueError(f"unknown call {call!r}")
        return self.op(op, args)

    def op(self, op: str, args: dict[str, Any]) -> Any:
        """One worker operation, named as the reference server's replicas name them."""
        with self.lock:
            if op == "init":
                from weightwire.torch_side.worker import WeightwireNCCLEngine

                if self.engine is not None:
                    self.engine.shutdown()
                self.engine = WeightwireNCCLEngine.standalone(model=self.sink, device=self.device)
                info = self.engine.parse_init_info(args["init_info"])
                self.engine.init_transfer_engine(info)
                self._trace_link()
                return {"rank": info.rank_offset}
            if op == "shutdown":
                engine, self.engine = self.engine, None
                if engine is not None:
                    engine.shutdown()
                return None
            if self.engine is None:
                raise RuntimeError("weight transfer engine is not initialized")
            if op == "start":
                self.engine.start_weight_update()
            elif op == "update":
                self.trace = {"update_enter": time.perf_counter(), "posts": [], "waits": []}
                self.engine.update_weights(args["update_info"])
                self.trace["update_exit"] = time.perf_counter()
                stats = self.engine.last_stats
                return (
                    {}
                    if stats is None
                    else {"tensors": stats.tensors, "chunks": stats.chunks, "nbytes": stats.nbytes}
                )
            elif op == "finish":
                self.engine.finish_weight_update()
            else:
                raise ValueError(f"unknown operation {op!r}")
        return None

    def _trace_link(self) -> None:
        """Time-stamp the receive link's posts and completed waits (bench only: private access)."""
        link = self.engine._core._link
        post, wait, bcast = link.post, link.wait, link.communicator.broadcast

        def traced_post(*a: Any, **k: Any) -> Any:
            self.trace.setdefault("post_enter", []).append(time.perf_counter())
            out = post(*a, **k)
            self.trace.setdefault("posts", []).append(time.perf_counter())
            return out

        def traced_bcast(*a: Any, **k: Any) -> Any:
            self.trace.setdefault("bcast_enter", []).append(time.perf_counter())
            return bcast(*a, **k)

        def traced_wait(*a: Any, **k: Any) -> Any:
            out = wait(*a, **k)
            self.trace.setdefault("waits", []).append(time.perf_counter())
            return out

        link.post, link.wait, link.communicator.broadcast = traced_post, traced_wait, traced_bcast

    def abort(self) -> None:
        """Out of band (no lock: an update may hold it): unblock a receive in flight."""
        engine = self.engine
        if engine is not None:
            engine.abort_transfer()

    def raw_begin(self, uid_b64: str, sizes: list[int], rounds: int, timeout: float) -> None:
        self.raw = {
            "thread": threading.Thread(
                target=self._raw_loop,
                daemon=True,
                args=(base64.b64decode(uid_b64), 1, sizes, rounds, timeout, self._store_raw),
            )
        }
        self.raw["thread"].start()

    def _store_raw(self, result: dict[str, Any]) -> None:
        self.raw["result"] = result

    def raw_end(self, timeout: float) -> dict[str, Any]:
        self.raw["thread"].join(timeout)
        return self.raw.get("result", {"error": "raw receive did not finish"})

    @staticmethod
    def _raw_loop(
        uid: bytes, rank: int, sizes: list[int], rounds: int, timeout: float, done: Any
    ) -> None:
        try:
            done({"times": raw_rounds(uid, rank, sizes, rounds, timeout)})
        except Exception as exc:
            done({"error": f"{type(exc).__name__}: {exc}"})


def control_client(cfg: dict[str, Any], timeout: float) -> Any:
    """A sender's control client: the reference server's HTTP routes at ``cfg["url"]``
    (``cfg["control"] == "http"``) or the shim at ``cfg["port"]``."""
    if cfg["control"] == "http":
        from weightwire.control.client import HTTPWeightSyncClient

        return HTTPWeightSyncClient(cfg["url"], timeout=timeout)
    return ShimClient(cfg["port"], timeout=timeout)


def raw_rounds(uid: bytes, rank: int, sizes: list[int], rounds: int, timeout: float) -> list[float]:
    """Raw CuPy NCCL: each round broadcasts ``sizes`` back to back on one stream, one buffer."""
    import cupy as cp

    from weightwire.backends.nccl.comm import NCCLCommunicator
    from weightwire.backends.nccl.library import NCCL_FLOAT32, NCCL_SUM, NCCL_UINT8

    comm = NCCLCommunicator.join(unique_id=uid, rank=rank, world_size=2, device=0, timeout=timeout)
    comm.warmup(timeout=timeout)
    raw, stream = comm.cupy_communicator, cp.cuda.Stream(non_blocking=True)
    with stream:
        buf, flag = cp.zeros(max(sizes), dtype=cp.uint8), cp.zeros(1, dtype=cp.float32)
    times = []
    for _ in range(rounds):
        raw.allReduce(
            flag.data.ptr, flag.data.ptr, 1, NCCL_FLOAT32, NCCL_SUM, stream.ptr
        )  # barrier
        comm.synchronize(stream, timeout=timeout)
        start = time.perf_counter()
        for size in sizes:
            raw.bcast(buf.data.ptr, size, NCCL_UINT8, 0, stream.ptr)
        comm.synchronize(stream, timeout=timeout)
        times.append(time.perf_counter() - start)
    comm.close()
    del buf
    cp.get_default_memory_pool().free_all_blocks()
    return times


def receiver_main(cfg: dict[str, Any]) -> None:
    receiver = Receiver()
    stop = threading.Event()

    class Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            # One JSON line per request; a client may keep the connection for many.
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while not stop.is_set():
                line = self.rfile.readline(1 << 26)
                if not line:
                    return
                msg = json.loads(line)
                try:
                    if msg["call"] == "quit":
                        stop.set()
                        result = None
                    else:
                        result = receiver.handle(msg["call"], msg["args"])
                    reply = {"ok": True, "result": result}
                except Exception as exc:
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                self.wfile.write((json.dumps(reply) + "\n").encode())
                self.wfile.flush()

    socketserver.ThreadingTCPServer.daemon_threads = True
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        Path(cfg["port_file"] + ".tmp").write_text(str(server.server_address[1]))
        os.replace(cfg["port_file"] + ".tmp", cfg["port_file"])
        stop.wait(cfg["deadline"] - time.time())
        server.shutdown()
    os._exit(0)
