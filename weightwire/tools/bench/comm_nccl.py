"""NCCL broadcast GPU0 -> GPU1: ``NCCLCommunicator`` against raw CuPy NCCL, same run.

    python -m weightwire.tools.bench.comm_nccl [--sizes-mib 64,256,1024] [--repeats 7] [--json]
    weightwire bench --backend nccl        # calls bench_nccl()

Two processes, one GPU each (rank 0 on GPU0 sends, rank 1 on GPU1 receives). Both
use the *same* NCCL communicator: the raw baseline calls CuPy's ``bcast`` on
``NCCLCommunicator.cupy_communicator`` directly, so NCCL's algorithm and channels are
identical and only our layer differs. Per size, each repeat runs four blocks of N
broadcasts, interleaved so clock drift hits all alike, each after a 1-element
all-reduce barrier:

- ``raw``: N x ``bcast`` on one stream, then ``stream.synchronize()``;
- ``weightwire``: N x ``broadcast(buf, stream=s)``, then ``synchronize(s, timeout)``
  (how the engines drive it);
- ``raw_sync`` / ``weightwire_sync``: a wait after every broadcast (``broadcast(buf)``
  without a stream, i.e. internal stream plus watchdog).

Reported: the receiver's median GB/s (1e9 bytes/s) and the ratios. Goal: >= 0.97 of
raw at >= 256 MiB. Received bytes are verified by sha256 once per size.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from weightwire.tools.bench.child import spawn_child

MODES = ("raw", "weightwire", "raw_sync", "weightwire_sync")
DEFAULT_SIZES = (64 << 20, 256 << 20, 1 << 30)


def _worker(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """One rank: join, warm up, run the schedule, return its timings (seconds per block)."""
    import cupy as cp

    from weightwire.backends.nccl.comm import NCCLCommunicator
    from weightwire.backends.nccl.library import NCCL_FLOAT32, NCCL_SUM, NCCL_UINT8, mint_unique_id

    uid_path = cfg["uid_path"]
    if rank == 0:
        uid = mint_unique_id()
        fd = os.open(uid_path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(uid)
        os.replace(uid_path + ".tmp", uid_path)
    else:
        deadline = time.monotonic() + cfg["timeout"]
        while not os.path.exists(uid_path):
            if time.monotonic() > deadline:
                raise TimeoutError("rank 0 never published the unique id")
            time.sleep(0.05)
        uid = Path(uid_path).read_bytes()
    comm = NCCLCommunicator.join(
        unique_id=uid, rank=rank, world_size=2, device=0, timeout=cfg["timeout"]
    )
    comm.warmup(timeout=cfg["timeout"])
    raw = comm.cupy_communicator
    timeout = cfg["timeout"]
    stream = cp.cuda.Stream(non_blocking=True)
    flag = cp.zeros(1, dtype=cp.float32)

    def barrier() -> None:
        raw.allReduce(flag.data.ptr, flag.data.ptr, 1, NCCL_FLOAT32, NCCL_SUM, stream.ptr)
        comm.synchronize(stream, timeout=timeout)

    out: dict[str, Any] = {"nccl": comm.version, "sizes": {}}
    for size in cfg["sizes"]:
        n = max(cfg["min_iters"], cfg["total_bytes"] // size)
        with stream:
            buf = (
                cp.random.randint(0, 256, size, dtype=cp.uint8)
                if rank == 0
                else cp.zeros(size, dtype=cp.uint8)
            )
        stream.synchronize()

        def raw_block(b: Any = buf, n: int = n, each: bool = False) -> None:
            for _ in range(n):
                raw.bcast(b.data.ptr, b.size, NCCL_UINT8, 0, stream.ptr)
                if each:
                    stream.synchronize()
            stream.synchronize()

        def ours_block(b: Any = buf, n: int = n, each: bool = False) -> None:
            for _ in range(n):
                if each:
                    comm.broadcast(b, root=0, timeout=timeout)  # internal stream + watchdog
                else:
                    comm.broadcast(b, root=0, stream=stream)
            comm.synchronize(stream, timeout=timeout)

        blocks = {
            "raw": raw_block,
            "weightwire": ours_block,
            "raw_sync": lambda: raw_block(each=True),
            "weightwire_sync": lambda: ours_block(each=True),
        }
        for mode in MODES:  # untimed pass: connection setup, allocator, first-call costs
            barrier()
            blocks[mode]()
        times: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(cfg["repeats"]):
            for mode in MODES:
                barrier()
                start = time.perf_counter()
                blocks[mode]()
                times[mode].append(time.perf_counter() - start)
        digest = hashlib.sha256(cp.asnumpy(buf).tobytes()).hexdigest()
        out["sizes"][str(size)] = {"iters": n, "times": times, "sha256": digest}
        del buf
        cp.get_default_memory_pool().free_all_blocks()
    comm.close()
    return out


def _launch(rank: int, cfg_path: str) -> subprocess.Popen[str]:
    return spawn_child(
        "comm_nccl",
        ["--worker", str(rank), "--config", cfg_path],
        env={"CUDA_VISIBLE_DEVICES": str(rank)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def bench_nccl(
    *,
    total_bytes: int = 1 << 30,
    buffer_bytes: int | None = None,
    repeats: int = 7,
    sizes: tuple[int, ...] = DEFAULT_SIZES,
    min_iters: int = 4,
    timeout: float = 120.0,
    deadline_s: float = 540.0,
) -> dict[str, Any]:
    """Run the two ranks and print a table; ``buffer_bytes`` adds one size to ``sizes``.

    ``total_bytes`` is what each timed block moves per size (at least ``min_iters``
    broadcasts). Returns ``{"nccl": version, "sizes": {size: {mode_gbps..., ratios}}}``.
    """
    all_sizes = sorted(set(sizes) | ({buffer_bytes} if buffer_bytes else set()))
    with tempfile.TemporaryDirectory(prefix="weightwire-bench-nccl-") as tmp:
        cfg = {
            "uid_path": os.path.join(tmp, "uid"),
            "sizes": all_sizes,
            "total_bytes": total_bytes,
            "repeats": max(1, repeats),
            "min_iters": min_iters,
            "timeout": timeout,
        }
        cfg_path = os.path.join(tmp, "config.json")
        Path(cfg_path).write_text(json.dumps(cfg))
        procs = [_launch(rank, cfg_path) for rank in (0, 1)]
        reports = []
        try:
            end = time.monotonic() + deadline_s
            for rank, proc in enumerate(procs):
                try:
                    out, err = proc.communicate(timeout=max(1.0, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise RuntimeError(
                        f"NCCL benchmark rank {rank} did not finish within {deadline_s} s"
                    ) from None
                lines = [line for line in out.splitlines() if line.startswith("{")]
                if proc.returncode != 0 or not lines:
                    raise RuntimeError(
                        f"NCCL benchmark rank {rank} failed (rc={proc.returncode}):\n{err[-4000:]}"
                    )
                reports.append(json.loads(lines[-1]))
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
    return _summarize(reports[0], reports[1])


def _summarize(sender: dict[str, Any], receiver: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = {"nccl": receiver["nccl"], "sizes": {}}
    print(
        f"NCCL {receiver['nccl']} broadcast GPU0 -> GPU1, receiver's median over repeats (GB/s = "
        "1e9 B/s):"
    )
    print(
        "| size | iters | raw | weightwire | ratio | raw+sync each | weightwire+sync each | "
        "ratio | bytes |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for key, rx in receiver["sizes"].items():
        size, n = int(key), rx["iters"]
        gbps = {m: size * n / statistics.median(rx["times"][m]) / 1e9 for m in MODES}
        ok = rx["sha256"] == sender["sizes"][key]["sha256"]
        row = {f"{m}_gbps": gbps[m] for m in MODES}
        row.update(
            iters=n,
            ratio=gbps["weightwire"] / gbps["raw"],
            ratio_sync=gbps["weightwire_sync"] / gbps["raw_sync"],
            bytes_verified=ok,
            sender_times=sender["sizes"][key]["times"],
            receiver_times=rx["times"],
        )
        result["sizes"][size] = row
        print(
            f"| {size >> 20} MiB | {n} | {gbps['raw']:.1f} | {gbps['weightwire']:.1f} | "
            f"{row['ratio']:.3f} | {gbps['raw_sync']:.1f} | {gbps['weightwire_sync']:.1f} | "
            f"{row['ratio_sync']:.3f} | {'sha256 ok' if ok else 'MISMATCH'} |"
        )
    if not all(r["bytes_verified"] for r in result["sizes"].values()):
        raise RuntimeError("receiver's bytes differ from the sender's")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mib", default="64,256,1024")
    parser.add_argument(
        "--total-mib",
        type=int,
        default=1024,
        help="bytes per timed block (>= --min-iters broadcasts)",
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--min-iters", type=int, default=4)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker is not None:
        report = _worker(args.worker, json.loads(Path(args.config).read_text()))
        print(json.dumps(report), flush=True)
        os._exit(0)  # skip interpreter teardown racing NCCL's threads
    import signal

    signal.signal(
        signal.SIGTERM, lambda *_: sys.exit(143)
    )  # so bench_nccl's finally kills both ranks
    sizes = tuple(int(s) << 20 for s in args.sizes_mib.split(","))
    result = bench_nccl(
        total_bytes=args.total_mib << 20,
        repeats=args.repeats,
        sizes=sizes,
        min_iters=args.min_iters,
    )
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
