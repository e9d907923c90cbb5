"""Whole rounds into vLLM's serving parameters on ONE GPU, against the physical floor.

    python benchmarks/bench_vllm_layout.py --out bench_vllm_layout.md [--engines torch,jax]
        [--budgets-gib 1,64] [--rounds 5] [--warmup 1]

The worker is vLLM's own plugin engine class (``VllmWeightwireIPCEngine``), run by
``tests/torch_side/vllm_stub.py`` with fakes for the few ``vllm.*`` pieces it imports
(vLLM's layerwise reload: buffered loads, a layer materialized at a time), loading into
parameters laid out like vLLM's Llama (fused ``qkv_proj`` / ``gate_up_proj``). The trainer
(``TorchTrainerEngine``, or the torch-free ``JAXTrainerEngine``) sits on the same GPU and
sends a Llama-3-8B-shaped bf16 set (16.06 GB) over ``weightwire_ipc`` with default
settings; ``--budgets-gib`` picks the stage budget (1: the default, the round streams;
64: the whole round is staged, for comparison).

Per row: seconds per round (median of ``--rounds`` after ``--warmup``: the whole
``send_weights()``), GB/s, and the ratio of the same run's **floor** to it: one device
copy of every tensor into its slice of the serving parameters (CUDA events, in the
worker). Worker extra memory: torch's peak over its baseline during a round plus the IPC
receive pool; trainer extra: the trainer process's device memory in use beyond its
weights, between rounds. ``bytes`` is ``ok`` when every Hugging Face tensor read back out
of the fused parameters has the trainer's digest.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GIB = 1 << 30
SHAPE = "llama3-8b"
DEVICE: Any = None  # the torch device of trainer and worker (main sets it)
BACKEND = "weightwire_ipc"
TIED = False  # the model's head is its embedding (Qwen2-0.5B): no lm_head.weight is sent


def _params(engine: str) -> dict[str, Any]:
    """The round's tensors on the trainer's GPU (names and shapes from the stub's model; a
    tied model's checkpoint has no ``lm_head.weight``)."""

    from tests.torch_side.vllm_stub import trainer_tensors

    tensors = dict(trainer_tensors(SHAPE, DEVICE, seed=1))
    if TIED:
        del tensors["lm_head.weight"]
    if engine == "torch":
        return tensors
    import jax

    out = {n: jax.dlpack.from_dlpack(t) for n, t in tensors.items()}  # zero-copy on the GPU
    jax.block_until_ready(list(out.values()))
    return out


class TrainerMemory:
    """The trainer process's extra device memory over its rounds. torch: the allocator's peak
    over what it held before (the weights). JAX: every byte JAX allocated (the weights are
    torch's tensors, shared through DLPack, so all of JAX's memory is extra)."""

    def __init__(self, engine: str) -> None:
        self.engine, self.before = engine, 0
        if DEVICE.type == "cuda" and engine != "jax":
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()

    def extra(self) -> int:
        if DEVICE.type != "cuda":
            return 0
        if self.engine == "jax":
            import jax

            return int(jax.devices()[0].memory_stats().get("peak_bytes_in_use", 0))
        import torch

        return int(torch.cuda.max_memory_allocated()) - self.before


def _timed(send: Any, args: argparse.Namespace, label: str = "") -> list[float]:
    """Seconds per ``send()``; with ``WEIGHTWIRE_IPC_TRACE`` each timed round is marked
    (``benchmarks/ipc_timeline.py`` prints where its milliseconds go)."""
    from weightwire._trace import dump_trace, trace

    for _ in range(args.warmup):
        send()
    walls = []
    for _ in range(args.rounds):
        trace(f"send> {label}")
        start = time.perf_counter()
        send()
        walls.append(time.perf_counter() - start)
        trace("send<")
    dump_trace("trainer")
    return walls


def _row(
    receiver: str,
    engine: str,
    budget: int | None,
    client: Any,
    nbytes: int,
    walls: list[float],
    trainer_extra: int,
    want: dict[str, Any],
) -> dict[str, Any]:
    """What the worker reports after the timed rounds: memory, the bytes, then the floor
    (last: it overwrites the parameters)."""
    mem = client.call("memory")
    ok = client.call("digests") == want
    floor = float(client.call("floor", {"reps": 5}))
    return {
        "receiver": receiver,
        "engine": engine,
        "budget": budget,
        "nbytes": nbytes,
        "round_s": statistics.median(walls),
        "floor_s": floor,
        "worker_extra": mem.get("peak", 0) - mem.get("baseline", 0) + mem.get("pool", 0),
        "pool": mem.get("pool", 0),
        "trainer_extra": trainer_extra,
        "ok": ok,
        "walls": walls,
    }


def run(
    engine: str, budget: int, client: Any, args: argparse.Namespace, mode: str = "pull"
) -> dict[str, Any]:
    import torch

    from tests.torch_side.vllm_stub import digest
    from weightwire.tools.bench.sync_models import make_source
    from weightwire.trainer import TrainerInitInfo

    if engine == "jax":
        from weightwire.jax_side.engine import JAXTrainerEngine as Engine
    else:
        from weightwire.torch_side.sender.engine import TorchTrainerEngine as Engine
    params = _params(engine)
    want = {n: digest(torch.from_dlpack(a) if engine == "jax" else a) for n, a in params.items()}
    if TIED:
        want["lm_head.weight"] = want["model.embed_tokens.weight"]
    nbytes = sum(int(a.nbytes) for a in params.values())
    memory = TrainerMemory(engine)
    info = TrainerInitInfo(
        backend=BACKEND,
        stage_budget_bytes=budget,
        device=0 if DEVICE.type == "cuda" else None,
        **({"ipc_mode": mode} if BACKEND == "weightwire_ipc" else {}),
    )
    trainer = Engine.trainer_init(info, client=client, source=make_source(params))
    try:
        walls = _timed(trainer.send_weights, args, f"{engine} {mode}")
        trainer_extra = memory.extra()
        path = type(trainer.session.sender).__name__
        receiver = "weightwire, write-through" if mode == "write_through" else "weightwire, pull"
        row = _row(receiver, engine, budget, client, nbytes, walls, trainer_extra, want)
        return {**row, "pipeline": path}
    finally:
        trainer.shutdown()


class PeerClient:
    """The four calls vLLM's trainer engine makes, over the loopback socket. The IPC handles
    travel pickled (``ipc_handles_pickled``), as vLLM's own HTTP client sends them."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.loop.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.loop.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        import base64
        import pickle

        info = dict(update_info)
        handles = info.pop("ipc_handles")
        info["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(handles)).decode()
        self.loop.update_weights(info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.loop.finish_weight_update()


def run_peer(packed: bool, client: Any, args: argparse.Namespace) -> dict[str, Any]:
    """vLLM 0.33's own IPC engines, both sides, from its sources (``--vllm-src``)."""
    import functools

    from tests.torch_side.vllm_stub import digest, install_vllm_sources

    vllm = install_vllm_sources(args.vllm_src)
    params = _params("torch")
    want = {n: digest(a) for n, a in params.items()}
    nbytes = sum(int(a.nbytes) for a in params.values())

    class TensorSource(vllm.base.WeightSource):  # type: ignore[misc,name-defined]
        metadata = functools.cached_property(
            lambda self: [
                vllm.base.ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in params.items()
            ]
        )

        def iter_full(self) -> Any:
            return iter(params.items())

    memory = TrainerMemory("torch")
    ipc = vllm.ipc_engine
    trainer = ipc.IPCTrainerWeightTransferEngine.trainer_init(
        ipc.IPCTrainerInitInfo(rank=0, packed=packed),
        client=PeerClient(client),
        source=TensorSource(),
    )
    walls = _timed(trainer.send_weights, args)
    mode = "packed 1 GiB" if packed else "unpacked (its default)"
    return _row(
        f"vLLM IPCWeightTransferEngine, {mode}",
        "torch",
        None,
        client,
        nbytes,
        walls,
        memory.extra(),
        want,
    )


def _budget(r: dict[str, Any]) -> str:
    return "" if r["budget"] is None else f"{r['budget'] / GIB:.0f} GiB"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| receiver | trainer | stage budget | GB/round | ms/round | GB/s "
        "| floor ms | floor / round "
        "| worker extra GB (pool) | trainer extra GB | bytes |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['receiver']} | {r['engine']} | {_budget(r)} | | | | | | | | {r['error']} |"
            )
            continue
        gb, s = r["nbytes"] / 1e9, r["round_s"]
        lines.append(
            f"| {r['receiver']} | {r['engine']} | {_budget(r)} "
            f"| {gb:.2f} | {s * 1e3:.1f} | {gb / s:.0f} "
            f"| {r['floor_s'] * 1e3:.1f} | {r['floor_s'] / s:.3f} "
            f"| {r['worker_extra'] / 1e9:.2f} ({r['pool'] / 1e9:.2f}) "
            f"| {r['trainer_extra'] / 1e9:.2f} "
            f"| {'ok' if r['ok'] else 'MISMATCH'}"
            f"{' (' + r['pipeline'] + ')' if 'pipeline' in r else ''} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    global DEVICE, BACKEND, SHAPE, TIED
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="torch,jax")
    ap.add_argument("--budgets-gib", default="1,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out")
    ap.add_argument(
        "--backend", default="weightwire_ipc", help="weightwire_tcp with --device cpu: a dry run"
    )
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--shape", default=SHAPE, help="llama3-8b, or tiny for a dry run")
    ap.add_argument(
        "--vllm-src",
        default=os.environ.get("WEIGHTWIRE_VLLM_SRC"),
        help="an unpacked vLLM 0.33 (the directory holding `vllm/`): adds its own IPC "
        "engines as the peer (pip download --no-deps vllm==0.33.0; unzip)",
    )
    ap.add_argument("--peer-modes", default="unpacked,packed")
    ap.add_argument(
        "--modes",
        default="pull,write_through",
        help="weightwire_ipc data paths: pull rows per stage budget, one write-through row",
    )
    ap.add_argument("--tied", action="store_true", help="the head is the embedding")
    args = ap.parse_args(argv)
    import torch

    DEVICE, BACKEND, SHAPE, TIED = torch.device(args.device), args.backend, args.shape, args.tied
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from weightwire.testing.loopback import spawn_loopback_cmd

    env = {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rows: list[dict[str, Any]] = []

    def worker(engine: str) -> tuple[Any, Any]:
        return spawn_loopback_cmd(
            [
                "-m",
                "tests.torch_side.vllm_stub",
                "--backend",
                BACKEND,
                "--engine",
                engine,
                "--device",
                args.device,
                "--shape",
                SHAPE,
                "--model",
                "llama-tied" if TIED else "llama",
            ],
            env={**env, "WEIGHTWIRE_VLLM_SRC": args.vllm_src or ""},
            timeout=300,
        )

    def attempt(receiver: str, engine: str, budget: int | None, fn: Any, *fn_args: Any) -> None:
        try:
            rows.append(fn(*fn_args))
        except Exception as exc:  # one failed row must not lose the others
            rows.append(
                {
                    "receiver": receiver,
                    "engine": engine,
                    "budget": budget,
                    "error": f"{type(exc).__name__}: {exc}",
                }
            )
        print(table(rows[-1:]), flush=True)

    modes = args.modes.split(",")
    proc, client = worker("weightwire")
    try:
        for engine in args.engines.split(","):
            if "pull" in modes:
                for gib in args.budgets_gib.split(","):
                    budget = int(float(gib) * GIB)
                    attempt("weightwire", engine, budget, run, engine, budget, client, args)
            if "write_through" in modes:
                budget = int(float(args.budgets_gib.split(",")[0]) * GIB)
                attempt(
                    "weightwire write-through",
                    engine,
                    budget,
                    run,
                    engine,
                    budget,
                    client,
                    args,
                    "write_through",
                )
    finally:
        client.exit()
        proc.wait(timeout=120)
    if args.vllm_src and DEVICE.type == "cuda":  # vLLM's IPC engine is CUDA-only
        proc, client = worker("vllm-ipc")
        try:
            for mode in args.peer_modes.split(","):
                attempt("vLLM", "torch", None, run_peer, mode == "packed", client, args)
        finally:
            client.exit()
            proc.wait(timeout=120)
    text = table(rows)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if rows and all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
