"""One rank of an NCCL fault case: ``python -m tests.faults._nccl_fault_peer CONFIG_JSON``.

Config: ``role`` (sender = rank 0 | receiver = rank 1), ``dir`` (where the sender of
each session publishes its unique id, mode 0600), ``sessions`` (names, run in order:
a survivor joins a fresh group per session), ``die_after`` (SIGKILL itself after that
many chunks of its first session, or null), ``nbytes``/``nchunks`` per session and
``timeout`` (seconds, every wait).

Chunk ``k`` of session ``i`` is filled with the byte ``(31 * i + 7 * k + 1) % 251``;
a receiver checks every byte. The last stdout line is a JSON report per session:
``ok`` chunks, or the error (type, message, seconds from the chunk's start) and what
a further broadcast on the aborted communicator raised. The unique id is never printed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def fill(session: str, chunk: int) -> int:
    # Keyed by the session's name, not its position: a survivor runs ["s1", "s2"] while a
    # fresh peer runs ["s2"] alone, and both must agree on s2's bytes.
    return (31 * sum(map(ord, session)) + 7 * chunk + 1) % 251


def unique_id(cfg: dict[str, Any], name: str) -> bytes:
    from weightwire.backends.nccl.library import mint_unique_id

    path = Path(cfg["dir"]) / f"{name}.uid"
    if cfg["role"] == "sender":
        uid = mint_unique_id()
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(uid)
        os.replace(tmp, path)
        return uid
    deadline = time.monotonic() + cfg["timeout"] * 3
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no unique id for session {name}")
        time.sleep(0.05)
    return path.read_bytes()


def run_session(cfg: dict[str, Any], index: int, name: str) -> dict[str, Any]:
    import cupy as cp

    from weightwire.backends.nccl.comm import NCCLCommunicator

    rank = 0 if cfg["role"] == "sender" else 1
    # The join waits longer than one transfer timeout: a survivor reaches a new session
    # only after its watchdog has declared the previous one dead (up to ``timeout``).
    comm = NCCLCommunicator.join(
        unique_id=unique_id(cfg, name),
        rank=rank,
        world_size=2,
        device=0,
        timeout=cfg["timeout"] * 3,
    )
    comm.warmup(timeout=cfg["timeout"])
    report: dict[str, Any] = {"ok": 0}
    for k in range(cfg["nchunks"]):
        if index == 0 and cfg.get("die_after") == k:
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        buf = (
            cp.full(cfg["nbytes"], fill(name, k), dtype=cp.uint8)
            if rank == 0
            else cp.zeros(cfg["nbytes"], cp.uint8)
        )
        start = time.monotonic()
        try:
            comm.broadcast(buf, root=0, timeout=cfg["timeout"])
        except Exception as exc:
            report.update(
                error_type=type(exc).__name__,
                error=str(exc)[:500],
                chunk=k,
                seconds=round(time.monotonic() - start, 2),
            )
            try:
                comm.broadcast(buf, root=0, timeout=1.0)
                report["after"] = "usable"
            except Exception as again:
                report["after"] = type(again).__name__
            return report
        if rank == 1 and not bool((buf == fill(name, k)).all()):
            report["corrupt_chunk"] = k
            return report
        report["ok"] += 1
    comm.close()
    return report


def main() -> None:
    cfg = json.loads(sys.argv[1])
    out: dict[str, Any] = {"role": cfg["role"], "sessions": {}}
    for i, name in enumerate(cfg["sessions"]):
        try:
            out["sessions"][name] = run_session(cfg, i, name)
        except BaseException as exc:
            out["sessions"][name] = {
                "fatal": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-2000:],
            }
    print(json.dumps(out), flush=True)
    os._exit(0)  # a thread parked in a dead communicator must not hold up interpreter exit


if __name__ == "__main__":
    main()
