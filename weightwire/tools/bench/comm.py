"""Data-plane throughput: weightwire communicators against the raw transport they wrap.

    weightwire bench [--backend weightwire_tcp]   # CPU, loopback (this module)
    weightwire bench --backend nccl|all           # GPU host (weightwire.tools.bench.comm_nccl)

TCP: one sender (this process) and one receiver (a child process). Each repeat sends
``--total-mib`` in ``--buffer-mib`` buffers twice over the same two processes: first with
a plain blocking ``sendall`` / ``recv_into`` loop on an untuned socket, then with
``TCPCommunicator.broadcast``. A repeat's clock stops when the receiver's one-byte
acknowledgement (on the raw connection, for both) comes back, so both numbers include
delivery, not just handing bytes to the kernel. Reports GB/s (1e9 bytes/s) and the ratio.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

from weightwire._extras import require
from weightwire._lifetime import child_env, die_with_parent
from weightwire.backends.nccl.spec import NCCL, WEIGHTWIRE_NCCL
from weightwire.backends.tcp.spec import TCP
from weightwire.tools._cli import backend_name, summary_parser

_RECEIVER_ROLE = "tcp-receiver"


def _recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("raw benchmark peer closed the connection")
        got += n


def _tcp_receiver(config: dict[str, Any]) -> None:
    """Child process: receive the raw and the weightwire rounds, acknowledge each, report a
    digest."""
    from weightwire.backends.tcp.comm import (
        TCPCommunicator,
    )  # keep import time out of the parent's clock

    count = config["total_bytes"] // config["buffer_bytes"]
    buf = np.empty(config["buffer_bytes"], dtype=np.uint8)
    view = buf.data  # the array's memoryview (numpy's stubs type the buffer protocol only on 3.12+)
    raw = socket.create_connection((config["host"], config["raw_port"]), timeout=120)
    raw.settimeout(None)
    comm = TCPCommunicator.connect(
        host=config["host"],
        port=config["port"],
        secret=base64.b64decode(config["secret_b64"]),
        rank=1,
        world_size=2,
        timeout=60,
        transfer_timeout=120,
        socket_buffer_bytes=config["socket_buffer_bytes"],
    )
    comm.warmup(timeout=60)
    digests = {}
    for _ in range(config["repeats"]):
        for _ in range(count):
            _recv_exact_into(raw, view)
        digests["raw"] = hashlib.sha256(view).hexdigest()
        raw.sendall(b"r")
        for _ in range(count):
            comm.broadcast(buf)
        digests["weightwire"] = hashlib.sha256(view).hexdigest()
        raw.sendall(b"w")
    comm.close()
    raw.close()
    print(json.dumps(digests), flush=True)


def bench_tcp(
    *,
    total_bytes: int = 1 << 30,
    buffer_bytes: int = 64 << 20,
    repeats: int = 3,
    socket_buffer_bytes: int | None = -1,
) -> dict[str, float]:
    """Raw loopback socket loop vs ``TCPCommunicator.broadcast``, same bytes, same two processes.

    ``socket_buffer_bytes``: the communicator's minimum socket buffers (-1: its default,
    ``None``: leave the kernel's); the raw loop always keeps the kernel's defaults.
    """
    from weightwire.backends.tcp.comm import SOCKET_BUFFER_BYTES
    from weightwire.backends.tcp.rendezvous import TCPRendezvous

    if socket_buffer_bytes == -1:
        socket_buffer_bytes = SOCKET_BUFFER_BYTES

    if total_bytes % buffer_bytes:
        raise ValueError("total_bytes must be a multiple of buffer_bytes")
    count = total_bytes // buffer_bytes
    data = np.random.default_rng(0).integers(0, 256, buffer_bytes, dtype=np.uint8)
    expected = hashlib.sha256(data.data).hexdigest()
    raw_listener = socket.create_server(("127.0.0.1", 0))
    rendezvous = TCPRendezvous(world_size=2, socket_buffer_bytes=socket_buffer_bytes)
    config = {
        **rendezvous.init_fields(),
        "raw_port": raw_listener.getsockname()[1],
        "total_bytes": total_bytes,
        "buffer_bytes": buffer_bytes,
        "repeats": repeats,
        "socket_buffer_bytes": socket_buffer_bytes,
    }
    child = subprocess.Popen(
        [sys.executable, "-m", "weightwire.tools.bench.comm", "--role", _RECEIVER_ROLE],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    try:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(json.dumps(config))  # the secret travels on a pipe, never on argv
        child.stdin.close()
        child.stdin = None  # so communicate() below only collects stdout
        raw_listener.settimeout(60)
        raw, _ = raw_listener.accept()
        raw.settimeout(None)
        comm = rendezvous.accept(timeout=60, transfer_timeout=120)
        comm.warmup(timeout=60)
        payload = data.data
        raw_s, ww_s = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(count):
                raw.sendall(payload)
            if raw.recv(1) != b"r":
                raise RuntimeError("raw benchmark receiver did not acknowledge")
            t1 = time.perf_counter()
            for _ in range(count):
                comm.broadcast(data)
            if raw.recv(1) != b"w":
                raise RuntimeError("weightwire benchmark receiver did not acknowledge")
            t2 = time.perf_counter()
            raw_s.append(t1 - t0)
            ww_s.append(t2 - t1)
        comm.close()
        raw.close()
        out, _ = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
        raw_listener.close()
        rendezvous.close()
    digests = json.loads(out.strip().splitlines()[-1])
    if digests != {"raw": expected, "weightwire": expected}:
        raise RuntimeError(f"receiver got different bytes: {digests} vs {expected}")
    raw_gbps = total_bytes / statistics.median(raw_s) / 1e9
    ww_gbps = total_bytes / statistics.median(ww_s) / 1e9
    result = {
        "total_bytes": total_bytes,
        "buffer_bytes": buffer_bytes,
        "repeats": repeats,
        "socket_buffer_bytes": socket_buffer_bytes or 0,
        "raw_gbps": raw_gbps,
        "weightwire_gbps": ww_gbps,
        "ratio": ww_gbps / raw_gbps,
        "raw_best_gbps": total_bytes / min(raw_s) / 1e9,
        "weightwire_best_gbps": total_bytes / min(ww_s) / 1e9,
    }
    buffers = (
        f">= {socket_buffer_bytes >> 10} KiB" if socket_buffer_bytes else "as the kernel sets them"
    )
    print(
        f"TCP loopback, {total_bytes / 2**20:.0f} MiB in {buffer_bytes / 2**20:.0f} MiB buffers, "
        f"median of {repeats}, weightwire socket buffers {buffers} (bytes verified by sha256):"
    )
    print(
        f"  raw sendall/recv_into loop : {raw_gbps:6.2f} GB/s  (best {result['raw_best_gbps']:.2f})"
    )
    print(
        f"  weightwire TCPCommunicator : {ww_gbps:6.2f} GB/s  (best "
        f"{result['weightwire_best_gbps']:.2f})"
    )
    print(f"  ratio weightwire / raw     : {result['ratio']:6.3f}")
    return result


def _load_bench_nccl() -> Any:
    """``bench_nccl(*, total_bytes, buffer_bytes, repeats) -> dict`` (GPU hosts).

    Imported only when asked for, so the TCP benchmark runs where cupy is missing.
    """
    from weightwire.tools.bench.comm_nccl import bench_nccl

    return bench_nccl


# Backend names as on every other command; the benchmark measures the communicator each uses
# (weightwire_nccl and stock nccl share NCCLCommunicator's data path). Old --transport values stay.
_BACKEND_TO_TRANSPORT = {
    TCP.name: "tcp",
    NCCL.name: "nccl",
    WEIGHTWIRE_NCCL.name: "nccl",
    "all": "all",
}


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = summary_parser(__doc__, prog)
    parser.add_argument(
        "--backend",
        type=backend_name,
        choices=tuple(_BACKEND_TO_TRANSPORT),
        default=TCP.name,
        help="data plane to measure: weightwire_tcp (TCPCommunicator, CPU loopback; alias tcp), "
        "nccl or weightwire_nccl (NCCLCommunicator, two GPUs), all (both)",
    )
    parser.add_argument(
        "--transport",
        dest="backend",
        choices=("tcp", "nccl", "all"),
        default=argparse.SUPPRESS,
        help="another name for --backend",
    )
    parser.add_argument("--total-mib", type=int, default=1024, help="MiB sent per repeat")
    parser.add_argument(
        "--buffer-mib", type=int, default=64, help="MiB per broadcast buffer (divides --total-mib)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed repeats; the median is reported"
    )
    parser.add_argument(
        "--socket-buffer-kib",
        type=int,
        default=-1,
        help="weightwire's minimum socket buffers in KiB (0: leave the kernel's; "
        "-1: the library's)",
    )
    parser.add_argument(
        "--json", action="store_true", help="also print one JSON line with every result"
    )
    parser.add_argument("--role", choices=(_RECEIVER_ROLE,), help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None, *, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if args.role == _RECEIVER_ROLE:
        die_with_parent()  # a receiver never outlives the benchmark that started it
        _tcp_receiver(json.loads(sys.stdin.read()))
        return 0
    for name in ("total_mib", "buffer_mib", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.total_mib % args.buffer_mib:
        parser.error(
            f"--total-mib {args.total_mib} must be a multiple of --buffer-mib {args.buffer_mib} "
            "(total_bytes must be a multiple of buffer_bytes)"
        )
    sizes = {
        "total_bytes": args.total_mib << 20,
        "buffer_bytes": args.buffer_mib << 20,
        "repeats": args.repeats,
    }
    results: dict[str, Any] = {}
    transport = _BACKEND_TO_TRANSPORT[backend_name(args.backend)]
    if transport in ("tcp", "all"):
        kib = args.socket_buffer_kib
        results["tcp"] = bench_tcp(
            **sizes, socket_buffer_bytes=-1 if kib < 0 else (kib << 10) or None
        )
    if transport in ("nccl", "all"):
        # Before any child starts: its import error would otherwise come back as a child's
        # traceback.
        require(
            "cupy",
            purpose=f"{prog or 'weightwire bench'} --backend {args.backend} (NCCL on two GPUs)",
        )
        results["nccl"] = _load_bench_nccl()(**sizes)
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
