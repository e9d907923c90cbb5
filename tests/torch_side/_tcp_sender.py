"""A minimal weightwire_tcp sender, run as a separate process by the torch-side tests.

Stands in for the trainer: TCPRendezvous + ``shared.framing`` packing, nothing else
(no transformers import: it starts from tensors the test saved with safetensors).
Reads one JSON config line on stdin; writes JSON lines on stdout: ``{"port": N}`` once
listening, then ``{"round": r, "chunks": n, "checksums": {...}}`` after each round.
"""

from __future__ import annotations

import base64
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _tiny import checksums, perturb, to_numpy  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from weightwire.shared.framing import pack_host, plan  # noqa: E402
from weightwire.shared.meta import ParamMeta  # noqa: E402
from weightwire.torch_side.dtypes import wire_name  # noqa: E402
from weightwire.transport.tcp import TCPRendezvous  # noqa: E402


def emit(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    cfg = json.loads(sys.stdin.readline())
    state = load_file(cfg["weights"])
    named = [(n, state[n]) for n in cfg["names"]]
    metas = [ParamMeta(n, wire_name(t.dtype), tuple(t.shape)) for n, t in named]
    chunks = plan(metas, packed=cfg["packed"], buffer_size_bytes=cfg["buffer_size"])
    rdv = TCPRendezvous(world_size=cfg["world_size"], secret=base64.b64decode(cfg["secret_b64"]))
    emit({"port": rdv.port})
    comm = rdv.accept(timeout=60)
    comm.warmup(timeout=60)
    for r in range(cfg["rounds"]):
        perturb(named, r)
        for i, chunk in enumerate(chunks):
            if r == cfg.get("die_in_round") and i == cfg.get("die_after_chunks"):
                os._exit(3)  # the trainer dies mid-stream: no close, no goodbye
            buf = pack_host([to_numpy(t) for _, t in named[chunk.start : chunk.stop]], chunk)
            comm.broadcast(buf, timeout=60)
        emit({"round": r, "chunks": len(chunks), "checksums": checksums(named)})
    comm.close()
    rdv.close()
    emit({"done": True})


if __name__ == "__main__":
    main()
