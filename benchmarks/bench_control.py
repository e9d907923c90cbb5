"""Fixed per-call cost of the HTTP control plane (issue 19: "0.5B round <= 3 ms"), on CPU.

    python benchmarks/bench_control.py [--rounds 400] [--json PATH]

A weight-sync round is three HTTP calls (start / update / finish); with the bytes on a
fast path (CUDA IPC) their fixed cost is most of a small model's round. This times, in
one run and interleaved (every iteration visits every case in a shuffled order, so a
noisy shared host hits all of them alike), the median per-call latency of:

- baselines: a JSON-line round trip over a raw loopback socket; a trivial FastAPI POST
  on the same uvicorn set-up as ours, from httpx and from stdlib ``http.client``;
- ``HTTPWeightSyncClient`` driving the reference server's real routes (``create_app``)
  through a whole empty-ish round (start; update with metadata reuse: empty lists;
  finish): ``instant``: the pool is ``bench.sync_http.InProcessPool`` over a receiver
  that answers at once (what ``bench_ipc.py --control http`` serves, minus the bytes);
  ``worker``: the real ``ReplicaPool`` over one subprocess that runs the real
  ``worker_proc.Loop`` (JSON lines on stdin/stdout, its control thread) with a stub
  worker whose ops return at once.

Every server runs in its own process, as in production; the client is this process.
The uvicorn HTTP parser (httptools if importable, else h11) and event loop (uvloop if
importable, else asyncio) are the ones ``weightwire serve`` picks; the header says which.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import importlib.util
import json
import multiprocessing as mp
import random
import socket
import statistics
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any

# -- the stub worker process (``--stub-worker``): the real worker_proc.Loop, ops that return at once


class _StubWorker:
    abort_epoch = 0
    cancel_epoch = 0
    spec = SimpleNamespace(max_reply_bytes=1 << 20)  # the WorkerSpec field the loop reads

    def describe(self) -> dict[str, Any]:
        return {"pid": 0, "device": "cpu", "vocab_size": 1, "max_model_len": 1, "params": 0}

    def op_init(self, init_info: dict[str, Any]) -> dict[str, Any]:
        return {"rank": init_info.get("rank_offset", 1)}

    def op_start(self, **_: Any) -> None:  # the round's bound (timeout_s) and flags
        return None

    def op_update(self, update_info: dict[str, Any], **_: Any) -> dict[str, Any]:
        return {"tensors": 0, "chunks": 0, "nbytes": 0, "seconds": 0.0}

    def op_finish(self, **_: Any) -> None:
        return None

    def op_shutdown(self) -> None:
        return None

    def _teardown(self) -> None:
        return None

    def abort_link(self) -> None:
        return None


def _stub_worker_main() -> int:
    from weightwire.tools.server import worker_proc

    out = worker_proc._claim_stdout()
    loop = worker_proc.Loop(_StubWorker(), out)  # type: ignore[arg-type]
    loop.reply({"id": 0, "ok": True, "result": _StubWorker().describe()})
    for line in sys.stdin.buffer:  # worker_proc.main's read loop
        loop.dispatch(json.loads(line))
    return 0


# -- servers, one process each -------------------------------------------------------------


def _raw_server(conn: Any) -> None:
    """JSON line in, JSON line out, over one kept-open loopback connection (the floor)."""
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1)
    conn.send({"port": lsock.getsockname()[1]})
    c, _ = lsock.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    f = c.makefile("rb")
    for line in f:
        msg = json.loads(line)
        c.sendall((json.dumps({"id": msg["id"], "ok": True, "result": None}) + "\n").encode())


class _Instant:
    """A receiver that answers every op at once (``InProcessPool``'s replica)."""

    async def call(self, op: str, args: dict[str, Any]) -> Any:
        return {"tensors": 0} if op == "update" else None

    def abort(self) -> None:
        return None


async def _app(kind: str) -> tuple[Any, Any]:
    """``(app, pool or None)`` for one server kind."""
    from fastapi import FastAPI

    from weightwire.backends.tcp.spec import TCP
    from weightwire.tools.server.app import ServerOptions, ServerState, create_app

    if kind == "trivial":
        app = FastAPI()

        @app.post("/x")
        async def x() -> dict[str, Any]:
            return {"ok": 1}

        return app, None
    if kind == "instant":
        from weightwire.tools.bench.sync_http import InProcessPool

        pool: Any = InProcessPool(_Instant())
    else:
        from weightwire.tools.server.replica import _LINE_LIMIT, Replica
        from weightwire.tools.server.replicas import ReplicaPool

        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--stub-worker",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=_LINE_LIMIT,
        )
        pool = ReplicaPool([Replica(0, proc)])
        await pool.replicas[0].wait_ready(60)
    return create_app(ServerState(pool=pool, options=ServerOptions(backend=TCP.name))), pool


def _http_server(kind: str, http_impl: str, loop_impl: str, conn: Any) -> None:
    import uvicorn

    from weightwire.tools import server as srv

    _bind = srv._bind
    # Older trees (before/after runs) have no event_loop_factory: they served on asyncio.
    event_loop_factory = getattr(srv, "event_loop_factory", lambda: None)

    async def main() -> None:
        app, pool = await _app(kind)
        sock = _bind("127.0.0.1", 0)
        # The same Config as ``weightwire serve`` (http: uvicorn's "auto" unless --http says
        # otherwise).
        server = uvicorn.Server(
            uvicorn.Config(
                app,
                log_level="warning",
                access_log=False,
                lifespan="off",
                server_header=False,
                http=http_impl,
            )
        )
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            await asyncio.sleep(0.01)
        conn.send(
            {"port": sock.getsockname()[1], "loop": type(asyncio.get_running_loop()).__module__}
        )
        await serving
        if pool is not None and hasattr(pool, "close"):
            await pool.close()

    factory = event_loop_factory() if loop_impl == "auto" else None
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main())


def _start(target: Any, *args: Any) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    ctx.Process(target=target, args=(*args, child), daemon=True).start()
    if not parent.poll(120):
        raise RuntimeError(f"{target.__name__}{args} did not start within 120 s")
    return parent.recv()


# -- the client side ------------------------------------------------------------------------------


def _cases(ports: dict[str, dict[str, Any]]) -> dict[str, Any]:
    import httpx

    from weightwire.control.client import HTTPWeightSyncClient
    from weightwire.shared.info import encode_secret

    raw = socket.create_connection(("127.0.0.1", ports["raw"]["port"]))
    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    raw_in = raw.makefile("rb")
    ids = iter(range(1, 1 << 62))

    def raw_call() -> None:
        raw.sendall((json.dumps({"id": next(ids), "op": "start", "args": {}}) + "\n").encode())
        json.loads(raw_in.readline())

    trivial = f"http://127.0.0.1:{ports['trivial']['port']}"
    hx = httpx.Client(base_url=trivial)
    stdlib = http.client.HTTPConnection("127.0.0.1", ports["trivial"]["port"])

    def stdlib_call() -> None:
        stdlib.request("POST", "/x", body=b"", headers={"content-length": "0"})
        stdlib.getresponse().read()

    cases: dict[str, Any] = {
        "raw socket JSON line": raw_call,
        "trivial POST, httpx": lambda: hx.post("/x").json(),
        "trivial POST, http.client": stdlib_call,
    }
    init = {
        "host": "127.0.0.1",
        "port": 1,
        "secret_b64": encode_secret(b"s" * 128),
        "rank_offset": 1,
        "world_size": 2,
    }
    reuse = {"names": [], "dtype_names": [], "shapes": []}
    for kind in ("instant", "worker"):
        client = HTTPWeightSyncClient(f"http://127.0.0.1:{ports[kind]['port']}", timeout=60)
        client.init_weight_transfer_engine(init)
        # A first round lists its tensors: the timed ones reuse that list (empty lists).
        client.start_weight_update()
        client.update_weights({"names": ["w"], "dtype_names": ["float32"], "shapes": [[1]]})
        client.finish_weight_update("v")
        # One case per round: its three calls are timed one by one and in order.
        cases[kind] = (
            client.start_weight_update,
            lambda c=client: c.update_weights(reuse),
            lambda c=client: c.finish_weight_update("v"),
        )
    return cases


def measure(
    cases: dict[str, Any], rounds: int, warmup: int, seed: int = 0
) -> dict[str, list[float]]:
    """Seconds per call, per case (round cases: ``kind start`` / ``update`` / ``finish`` /
    ``round``)."""
    samples: dict[str, list[float]] = {}
    order = list(cases)
    rng = random.Random(seed)
    clock = time.perf_counter
    for it in range(warmup + rounds):
        rng.shuffle(order)
        for name in order:
            case = cases[name]
            if callable(case):
                t0 = clock()
                case()
                dt = [clock() - t0]
                keys = [name]
            else:
                dt = []
                for call in case:
                    t0 = clock()
                    call()
                    dt.append(clock() - t0)
                dt.append(sum(dt))
                keys = [f"{name} {k}" for k in ("start", "update", "finish", "round")]
            if it >= warmup:
                for k, v in zip(keys, dt, strict=True):
                    samples.setdefault(k, []).append(v)
    return samples


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--rounds", type=int, default=400, help="measured iterations (each visits every case)"
    )
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the medians (µs) here")
    p.add_argument(
        "--http",
        default="auto",
        choices=("auto", "h11", "httptools"),
        help="uvicorn HTTP parser (default auto: what weightwire serve gets)",
    )
    p.add_argument(
        "--loop",
        default="auto",
        choices=("auto", "asyncio"),
        help="server event loop (default auto: uvloop where installed, as weightwire serve)",
    )
    p.add_argument("--stub-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.stub_worker:
        return _stub_worker_main()
    ports = {"raw": _start(_raw_server)}
    for kind in ("trivial", "instant", "worker"):
        ports[kind] = _start(_http_server, kind, args.http, args.loop)
    parser = (
        args.http
        if args.http != "auto"
        else "httptools"
        if importlib.util.find_spec("httptools")
        else "h11"
    )
    print(
        f"uvicorn http parser: {parser}; server event loop: {ports['trivial']['loop']}; "
        f"{args.rounds} interleaved iterations after {args.warmup} warm-up"
    )
    samples = measure(_cases(ports), args.rounds, args.warmup)
    med = {k: statistics.median(v) * 1e6 for k, v in samples.items()}
    p90 = {k: statistics.quantiles(v, n=10)[-1] * 1e6 for k, v in samples.items()}
    raw, triv, std = (
        med["raw socket JSON line"],
        med["trivial POST, httpx"],
        med["trivial POST, http.client"],
    )
    print(
        f"{'case':34} {'median µs':>10} {'p90 µs':>8} {'/ raw':>7} {'/ trivial httpx':>16} "
        f"{'/ trivial http.client':>22}"
    )
    for k in med:
        print(
            f"{k:34} {med[k]:10.0f} {p90[k]:8.0f} {med[k] / raw:7.1f} {med[k] / triv:16.2f} "
            f"{med[k] / std:22.2f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "parser": parser,
                    "loop": ports["trivial"]["loop"],
                    "median_us": med,
                    "p90_us": p90,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "bench-control"
    sys.exit(main())
