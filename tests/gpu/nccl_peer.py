"""One rank of a GPU NCCL test, run as its own process (``python nccl_peer.py CONFIG.json``).

The parent test gives each process one GPU (``CUDA_VISIBLE_DEVICES``). Roles:

- ``jax-sender``: rank 0, torch-free. Builds the test tensors with JAX (random bits,
  so every bit pattern incl. NaN payloads must survive), mints the NCCL unique id and
  hands it to the receiver through a 0600 file, joins, warms up, then sends each mode:
  ``packed`` (chunks packed with ``bitcast_convert_type`` + ``jnp.concatenate`` per
  ``shared.framing.plan_packed``) and ``unpacked`` (one ``broadcast_typed`` per tensor).
- ``torch-receiver``: rank 1, jax-free. Receives each mode into torch tensors
  (packed: uint8 chunks on a side stream, then ``tensor.view(dtype)`` unpacking).
- ``jax-idle-sender`` / ``torch-stalled-receiver``: join and warm up, then the sender
  never sends; the receiver's watchdog must turn the hang into ``TransferTimeout``.

Each process prints one JSON report line last (per-tensor sha256, timings, or the
error it met) and leaves with ``os._exit`` so that a rendezvous thread still parked
in NCCL cannot hold up interpreter teardown. The unique id is never printed.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from weightwire.backends.nccl.comm import NCCLCommunicator
from weightwire.backends.nccl.library import mint_unique_id
from weightwire.shared.dtypes import WIRE_DTYPES
from weightwire.shared.framing import plan_packed
from weightwire.shared.meta import ParamMeta


def metas_of(cfg: dict[str, Any]) -> list[ParamMeta]:
    return [ParamMeta(name, dtype, tuple(shape)) for name, dtype, shape in cfg["spec"]]


def publish_uid(path: str, uid: bytes) -> None:
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(uid)
    os.replace(tmp, path)  # the reader never sees a partial id


def wait_uid(path: str, timeout: float) -> bytes:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return Path(path).read_bytes()
        time.sleep(0.05)
    raise TimeoutError(f"no unique id appeared at {path} within {timeout} s")


def join(cfg: dict[str, Any], report: dict[str, Any], uid: bytes, rank: int) -> NCCLCommunicator:
    start = time.monotonic()
    report["join_started"] = True
    try:
        return NCCLCommunicator.join(
            unique_id=uid, rank=rank, world_size=2, device=0, timeout=cfg["join_timeout"]
        )
    finally:
        report["join_s"] = time.monotonic() - start


# -- JAX side --------------------------------------------------------------------------------


def make_jax_arrays(metas: list[ParamMeta], seed: int) -> list[Any]:
    import jax
    import jax.numpy as jnp

    uints = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}
    out = []
    for i, meta in enumerate(metas):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), i)
        row = WIRE_DTYPES[meta.dtype]
        if meta.dtype == "bool":
            out.append((jax.random.bits(key, meta.shape, jnp.uint8) & 1).astype(jnp.bool_))
            continue
        bits = jax.random.bits(key, meta.shape, uints[row.itemsize])
        out.append(
            bits if bits.dtype == row.numpy else jax.lax.bitcast_convert_type(bits, row.numpy)
        )
    jax.block_until_ready(out)
    return out


def jax_as_bytes(x: Any) -> Any:
    import jax
    import jax.numpy as jnp

    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8).reshape(-1)
    return jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1)


def jax_sender(cfg: dict[str, Any], report: dict[str, Any]) -> None:
    import jax

    jax.config.update("jax_enable_x64", True)  # float64 / int64 tensors
    import jax.numpy as jnp

    metas = metas_of(cfg)
    arrays = make_jax_arrays(metas, cfg["seed"])
    report["hashes"] = {
        m.name: hashlib.sha256(np.asarray(a).tobytes()).hexdigest()
        for m, a in zip(metas, arrays, strict=True)
    }
    report["nbytes"] = sum(m.nbytes for m in metas)
    uid = mint_unique_id()
    publish_uid(cfg["uid_path"], uid)
    comm = join(cfg, report, uid, rank=0)
    report["nccl"] = comm.version
    comm.warmup(timeout=cfg["transfer_timeout"])
    if cfg.get("idle_s"):
        time.sleep(cfg["idle_s"])  # never sends: the receiver's watchdog must fire
        comm.abort()
        return
    seconds: dict[str, float] = {}
    for mode in cfg["modes"]:
        start = time.perf_counter()
        if mode == "packed":
            chunks = plan_packed(metas, cfg["buffer_bytes"])
            for chunk in chunks:
                parts = [jax_as_bytes(arrays[i]) for i in range(chunk.start, chunk.stop)]
                buf = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
                assert buf.size == chunk.nbytes, (buf.size, chunk.nbytes)
                comm.broadcast(buf, root=0, timeout=cfg["transfer_timeout"])
            report["chunks"] = len(chunks)
        else:
            for meta, array in zip(metas, arrays, strict=True):
                comm.broadcast_typed(
                    array,
                    nccl_dtype=WIRE_DTYPES[meta.dtype].nccl,
                    count=meta.numel,
                    root=0,
                    timeout=cfg["transfer_timeout"],
                )
        seconds[mode] = time.perf_counter() - start
    report["seconds"] = seconds
    comm.close()


# -- torch side ------------------------------------------------------------------------------


def torch_digest(t: Any) -> list[Any]:
    import torch

    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    return [str(t.dtype).removeprefix("torch."), list(t.shape), hashlib.sha256(raw).hexdigest()]


def torch_receiver(cfg: dict[str, Any], report: dict[str, Any]) -> None:
    import torch

    metas = metas_of(cfg)
    dev = torch.device("cuda", 0)
    uid = wait_uid(cfg["uid_path"], cfg["join_timeout"])
    comm = join(cfg, report, uid, rank=1)
    comm.warmup(timeout=cfg["transfer_timeout"])
    timeout = cfg["transfer_timeout"]
    if cfg.get("expect_stall"):
        buf = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
        start = time.monotonic()
        try:
            comm.broadcast(buf, root=0, timeout=timeout)
            report["stall_result"] = "returned"
        except Exception as exc:
            report.update(stall_error_type=type(exc).__name__, stall_error=str(exc))
        report["stall_s"] = time.monotonic() - start
        try:
            comm.warmup(timeout=5)
            report["after_stall"] = "usable"
        except Exception as exc:
            report["after_stall"] = f"{type(exc).__name__}: {exc}"
        return
    received: dict[str, dict[str, Any]] = {}
    seconds: dict[str, float] = {}
    for mode in cfg["modes"]:
        got: dict[str, Any] = {}
        start = time.perf_counter()
        if mode == "packed":
            stream = torch.cuda.Stream(device=dev)
            for chunk in plan_packed(metas, cfg["buffer_bytes"]):
                buf = torch.empty(chunk.nbytes, dtype=torch.uint8, device=dev)
                stream.wait_stream(
                    torch.cuda.current_stream(dev)
                )  # buf's block may be in use there
                comm.broadcast(buf, root=0, timeout=timeout, stream=stream.cuda_stream)
                comm.synchronize(stream.cuda_stream, timeout=timeout)
                for meta, offset in zip(
                    metas[chunk.start : chunk.stop], chunk.offsets, strict=True
                ):
                    piece = buf[offset : offset + meta.nbytes]
                    if offset % meta.itemsize:  # torch views need itemsize-aligned offsets
                        piece = piece.clone()
                    got[meta.name] = torch_digest(
                        piece.view(getattr(torch, meta.dtype)).view(meta.shape)
                    )
        else:
            for meta in metas:
                t = torch.empty(meta.shape, dtype=getattr(torch, meta.dtype), device=dev)
                comm.broadcast_typed(
                    t,
                    nccl_dtype=WIRE_DTYPES[meta.dtype].nccl,
                    count=meta.numel,
                    root=0,
                    timeout=timeout,
                )
                got[meta.name] = torch_digest(t)
        seconds[mode] = time.perf_counter() - start
        received[mode] = got
    report["received"] = received
    report["seconds"] = seconds
    comm.close()


ROLES = {
    "jax-sender": jax_sender,
    "jax-idle-sender": jax_sender,
    "torch-receiver": torch_receiver,
    "torch-stalled-receiver": torch_receiver,
}


def main() -> None:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    report: dict[str, Any] = {"role": cfg["role"]}
    start = time.monotonic()
    try:
        ROLES[cfg["role"]](cfg, report)
    except BaseException as exc:
        report.update(
            error_type=type(exc).__name__, error=str(exc), traceback=traceback.format_exc()
        )
    report["elapsed"] = time.monotonic() - start
    sys.stderr.flush()
    print(json.dumps(report), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
