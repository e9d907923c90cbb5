"""A minimal trainer stand-in, run as a separate process by the torch-side tests.

TCPRendezvous (``weightwire_tcp``) or NCCLCommunicator rank 0 (``weightwire_nccl``)
plus ``shared.framing`` packing, nothing else; no transformers import: it starts from
tensors the test saved with safetensors. Reads one JSON config line on stdin; writes
JSON lines on stdout: ``{"port": N}`` (TCP, once listening), then
``{"round": r, "chunks": n, "checksums": {...}}`` after each round it sent.
"""

from __future__ import annotations

import base64
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from _tiny import checksums, perturb, to_numpy
from safetensors.torch import load_file

from weightwire.shared.dtypes import wire_dtype
from weightwire.shared.framing import pack_host, plan
from weightwire.shared.meta import ParamMeta
from weightwire.torch_side.dtypes import wire_name


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def connect(cfg: dict):
    if cfg.get("backend", "weightwire_tcp") == "weightwire_tcp":
        from weightwire.backends.tcp.rendezvous import TCPRendezvous

        rdv = TCPRendezvous(
            world_size=cfg["world_size"], secret=base64.b64decode(cfg["secret_b64"])
        )
        emit({"port": rdv.port})
        comm = rdv.accept(timeout=60)
        rdv.close()
    else:
        from weightwire.backends.nccl.comm import NCCLCommunicator

        torch.cuda.set_device(0)
        comm = NCCLCommunicator.join(
            unique_id=base64.b64decode(cfg["unique_id_b64"]),
            rank=0,
            world_size=cfg["world_size"],
            device=0,
            timeout=60,
        )
    comm.warmup(timeout=60)
    return comm


def send(comm, cfg: dict, arrays: list, metas: list[ParamMeta], chunk) -> None:
    buf = pack_host(arrays, chunk)
    if cfg.get("backend", "weightwire_tcp") == "weightwire_tcp":
        comm.broadcast(buf, timeout=60)
        return
    dev = torch.from_numpy(buf).to("cuda:0")
    if cfg["packed"]:
        comm.broadcast(dev, timeout=60)
    else:  # unpacked: the tensor's own NCCL dtype, as a stock vLLM worker receives it
        meta = metas[chunk.start]
        comm.broadcast_typed(
            dev, nccl_dtype=wire_dtype(meta.dtype).nccl, count=meta.numel, timeout=60
        )


def main() -> None:
    cfg = json.loads(sys.stdin.readline())
    state = load_file(cfg["weights"])
    named = [(n, state[n]) for n in cfg["names"]]
    metas = [ParamMeta(n, wire_name(t.dtype), tuple(t.shape)) for n, t in named]
    chunks = plan(metas, packed=cfg["packed"], buffer_size_bytes=cfg["buffer_size"])
    comm = connect(cfg)
    if cfg.get("stall_s"):
        time.sleep(cfg["stall_s"])  # joined and warmed up, then never sends
    for r in range(cfg["rounds"]):
        perturb(named, r)
        for i, chunk in enumerate(chunks):
            if r == cfg.get("die_in_round") and i == cfg.get("die_after_chunks"):
                os._exit(3)  # the trainer dies mid-stream: no close, no goodbye
            send(comm, cfg, [to_numpy(t) for _, t in named[chunk.start : chunk.stop]], metas, chunk)
        emit({"round": r, "chunks": len(chunks), "checksums": checksums(named)})
    comm.close()
    emit({"done": True})


if __name__ == "__main__":
    main()
