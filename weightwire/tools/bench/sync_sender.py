"""The sender process of ``weightwire bench --sync``: a trainer engine's rounds on GPU 0.

One process per (engine, control plane): each config's timed rounds, one traced round, a round
under the memory sampler, then raw NCCL broadcasts of the same chunk sizes as the yardstick.
Prints the rows as one JSON line on stdout for the parent (``sync.py``).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import statistics
import sys
import threading
import time
from typing import Any

from weightwire.backends.nccl.spec import WEIGHTWIRE_NCCL
from weightwire.tools.bench.sync_models import build_params, make_source
from weightwire.tools.bench.sync_shim import control_client, raw_rounds, rpc
from weightwire.tools.bench.sync_trace import trace_round


def error_row(engine: str, control: str, model: str, mode: str, error: str) -> dict[str, Any]:
    """A config that did not run: the table shows the error in place of its numbers."""
    return {"engine": engine, "control": control, "model": model, "mode": mode, "error": error}


class MemSampler:
    """Peak of (framework + CuPy pool) device bytes in use, polled in a thread, above ``base``."""

    def __init__(self, engine: str, base: int | None = None) -> None:
        import cupy as cp

        self._pool = cp.get_default_memory_pool()
        if engine == "jax":
            import jax

            dev = jax.devices()[0]
            self._framework = lambda: int((dev.memory_stats() or {}).get("bytes_in_use", 0))
        else:
            import torch

            self._framework = lambda: int(torch.cuda.memory_allocated(0))
        self.base = self.sample() if base is None else base
        self.peak = self.sample()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> int:
        return self._framework() + int(self._pool.used_bytes())

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self.sample())

    def __enter__(self) -> MemSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.peak = max(self.peak, self.sample())


def run_config(
    engine_kind: str,
    model: str,
    params: dict[str, Any],
    packed: bool,
    buf: int,
    nb: int,
    cfg: dict[str, Any],
) -> dict[str, Any]:
    from weightwire.backends.nccl.library import mint_unique_id
    from weightwire.shared.framing import plan
    from weightwire.shared.timeouts import Timeouts
    from weightwire.trainer.config import TrainerInitInfo
    from weightwire.trainer.engine import TrainerEngine

    Engine: type[TrainerEngine]
    if engine_kind == "jax":
        from weightwire.jax_side.engine import JAXTrainerEngine as Engine
    else:
        from weightwire.torch_side.sender.engine import TorchTrainerEngine as Engine
    t = cfg["timeout"]
    row: dict[str, Any] = {
        "engine": engine_kind,
        "control": cfg["control"],
        "model": model,
        "mode": f"packed {buf >> 20} MiB x{nb}" if packed else "unpacked",
        "nbytes": sum(int(a.nbytes) for a in params.values()),
        "tensors": len(params),
    }
    source = make_source(params)
    client = control_client(cfg, t + 60)
    metas = source.metadata()
    row["largest"] = max(m.nbytes for m in metas)
    row["bound"] = nb * buf + row["largest"] if packed else row["largest"]
    wanted: dict[str, Any] = dict(
        backend=WEIGHTWIRE_NCCL.name,
        packed=packed,
        packed_buffer_size_bytes=buf,
        packed_num_buffers=nb,
        device=0,
        server_version="0.33.0",
        inference_world_size=1,
        timeouts=Timeouts(http_s=t + 30, connect_s=t, warmup_s=t, transfer_s=t),
    )
    known = {f.name for f in dataclasses.fields(TrainerInitInfo)}
    if (
        cfg["control"] == "http"
    ):  # the floor of one round trip here: GET /version, no worker behind it
        samples = []
        for _ in range(30):
            began = time.perf_counter()
            client.version()
            samples.append(time.perf_counter() - began)
        row["http_rtt_ms"] = 1e3 * statistics.median(samples)
    base = MemSampler(engine_kind).sample()  # before the engine: its kept buffers count as extra
    engine = Engine.trainer_init(
        TrainerInitInfo(**{k: v for k, v in wanted.items() if k in known}),
        client=client,
        source=source,
    )
    try:
        for _ in range(cfg["warmup"]):
            engine.send_weights()
        walls, control, finish = [], [], []
        for _ in range(cfg["rounds"]):
            start = time.perf_counter()
            metrics = engine.send_weights()
            walls.append(time.perf_counter() - start)
            control.append(metrics.seconds.get("control", 0.0))
            finish.append(metrics.seconds.get("finish", 0.0))
        row["chunks"] = metrics.chunks
        row["phases_ms"] = {k: round(v * 1e3, 2) for k, v in metrics.seconds.items()}
        row["timeline"] = trace_round(engine, lambda: rpc(cfg["port"], "trace", t))
        rpc(cfg["port"], "mem_reset", t)
        with MemSampler(engine_kind, base) as mem:
            engine.send_weights()
        got = rpc(cfg["port"], "mem_peak", t)
        row.update(
            send_extra=mem.peak - mem.base,
            recv_extra=got["peak_extra"],
            loaded_ok=got["nbytes"] == row["nbytes"] and got["tensors"] == row["tensors"],
        )
    finally:
        engine.shutdown()
        close = getattr(client, "close", None)
        if close is not None:
            close()
    row.update(
        round_s=statistics.median(walls),
        control_ms=1e3 * statistics.median(control),
        finish_ms=1e3 * statistics.median(finish),
        walls=walls,
    )
    sizes = [c.nbytes for c in plan(metas, packed=packed, buffer_size_bytes=buf) if c.nbytes]
    uid = mint_unique_id()
    rpc(
        cfg["port"],
        "raw_begin",
        t,
        uid_b64=base64.b64encode(uid).decode(),
        sizes=sizes,
        rounds=cfg["warmup"] + cfg["rounds"],
        timeout=t,
    )
    raw = raw_rounds(uid, 0, sizes, cfg["warmup"] + cfg["rounds"], t)[cfg["warmup"] :]
    rx = rpc(cfg["port"], "raw_end", t + 30, timeout=t)
    if "error" in rx:
        raise RuntimeError(f"raw receiver: {rx['error']}")
    row.update(raw_s=statistics.median(raw), raw_walls=raw)
    return row


def sender_main(cfg: dict[str, Any]) -> None:
    from weightwire.backends.nccl.library import nccl_available

    engine, control = cfg["engine"], cfg["control"]
    rows: list[dict[str, Any]] = []
    if not nccl_available():
        rows.append(
            error_row(engine, control, "-", "-", "no CuPy NCCL / CUDA device on the sender")
        )
        cfg["models"] = []
    for model in cfg["models"]:
        if time.time() > cfg["deadline"] - 60:
            rows.append(error_row(engine, control, model, "-", "skipped: out of time"))
            continue
        params = build_params(model, engine)
        configs = [(True, b, n) for b in cfg["buffers"] for n in cfg["num_buffers"]]
        configs += [(False, cfg["buffers"][0], 1)] if cfg["unpacked"] else []
        for packed, buf, nb in configs:
            mode = f"packed {buf >> 20} MiB x{nb}" if packed else "unpacked"
            if time.time() > cfg["deadline"] - 30:
                rows.append(error_row(engine, control, model, mode, "skipped: out of time"))
                continue
            try:
                rows.append(run_config(engine, model, params, packed, buf, nb, cfg))
            except Exception as exc:
                rows.append(
                    error_row(engine, control, model, mode, f"{type(exc).__name__}: {exc}"[:300])
                )
            print(json.dumps(rows[-1], default=str), file=sys.stderr, flush=True)
        del params
    print(json.dumps(rows), flush=True)
    os._exit(0)
