"""GPU trainer process for ``test_engine_nccl_gpu.py`` (and a quick manual benchmark).

Builds a Llama-shaped weight set of ``--mib`` MiB on the visible GPU (JAX or torch),
drives a loopback receiver (``weightwire.testing.loopback``) through ``--rounds``
rounds with a trainer engine, compares the receiver's per-tensor sha256 with the
sent tensors after every round, and prints one JSON line with the results.

    CUDA_VISIBLE_DEVICES=0 python tests/trainer/gpu_sender.py --address 127.0.0.1:PORT \
        --framework jax --backend weightwire_nccl --packed 1 --mib 1100
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from typing import Any

from weightwire.shared.meta import ParamMeta
from weightwire.shared.source import WeightSource
from weightwire.shared.timeouts import Timeouts
from weightwire.testing.loopback import LoopbackClient
from weightwire.trainer import TrainerInitInfo

HIDDEN, KV, FFN = 4096, 1024, 8192


def shapes(mib: int, framework: str = "torch") -> list[tuple[str, str, tuple[int, ...]]]:
    """HF-named tensors: bf16 matrices up to ``mib`` MiB, plus odd sizes in every wire
    dtype (JAX without x64 has no float64 / int64 arrays: those are torch only)."""
    out = [("model.embed_tokens.weight", "bfloat16", (8003, HIDDEN))]
    per_layer = [
        ("self_attn.q_proj.weight", (HIDDEN, HIDDEN)),
        ("self_attn.k_proj.weight", (KV, HIDDEN)),
        ("self_attn.v_proj.weight", (KV, HIDDEN)),
        ("self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
        ("mlp.gate_proj.weight", (FFN, HIDDEN)),
        ("mlp.up_proj.weight", (FFN, HIDDEN)),
        ("mlp.down_proj.weight", (HIDDEN, FFN)),
    ]
    total, layer = 8003 * HIDDEN * 2, 0
    while total < mib << 20:
        p = f"model.layers.{layer}."
        out.append((p + "input_layernorm.weight", "float32", (HIDDEN,)))
        for name, shape in per_layer:
            out.append((p + name, "bfloat16", shape))
            total += shape[0] * shape[1] * 2
        out.append((p + "post_attention_layernorm.weight", "float32", (HIDDEN,)))
        layer += 1
    out += [
        ("model.norm.weight", "float32", (HIDDEN,)),
        ("model.odd.half", "float16", (7,)),
        ("model.odd.scalar", "float32", ()),
        ("model.odd.ids", "int32", (3, 5)),
        ("model.odd.fp8", "float8_e4m3fn", (33,)),
        ("model.odd.fp8b", "float8_e5m2", (17, 3)),
        ("model.odd.i8", "int8", (11,)),
        ("model.odd.u8", "uint8", (13,)),
        ("model.odd.mask", "bool", (9, 2)),
    ]
    if framework == "torch":
        out += [("model.odd.f64", "float64", (5,)), ("model.odd.i64", "int64", (2, 3))]
    out.append(("lm_head.weight", "bfloat16", (8003, HIDDEN)))
    return out


class Dict(WeightSource):
    def __init__(
        self, tensors: dict[str, Any], metas: list[ParamMeta], *, stop_at: int = -1, stop: str = ""
    ) -> None:
        self.tensors, self._metas = tensors, metas
        self.stop_at, self.stop = (
            stop_at,
            stop,
        )  # fault tests: die / pause when yielding tensor ``stop_at``

    def metadata(self) -> list[ParamMeta]:
        return self._metas

    def __iter__(self):
        for i, item in enumerate(self.tensors.items()):
            if i == self.stop_at and self.stop == "kill":
                import os
                import signal

                os.kill(
                    os.getpid(), signal.SIGKILL
                )  # the trainer dies mid-round, nothing cleaned up
            if i == self.stop_at and self.stop == "pause":
                print("PAUSED", flush=True)  # the test kills the worker now, then says go on
                sys.stdin.readline()
            yield item


def jax_side(spec: list, seed: int) -> tuple[Any, dict[str, Any], Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from weightwire.jax_side.engine import JAXTrainerEngine

    key = jax.random.PRNGKey(seed)
    tensors = {}
    for i, (name, dtype, shape) in enumerate(spec):
        k = jax.random.fold_in(key, i)
        if dtype == "bool":
            tensors[name] = jax.random.bernoulli(k, 0.5, shape)
        elif dtype in ("int8", "uint8", "int32"):
            info = jnp.iinfo(dtype)
            tensors[name] = jax.random.randint(
                k, shape, max(info.min, -1000), min(info.max, 1000), jnp.dtype(dtype)
            )
        else:
            tensors[name] = jax.random.normal(k, shape, jnp.float32).astype(jnp.dtype(dtype))
    jax.block_until_ready(tensors)

    def sha(x: Any) -> str:
        return hashlib.sha256(np.ascontiguousarray(np.asarray(x)).tobytes()).hexdigest()

    return JAXTrainerEngine, tensors, sha


def torch_side(spec: list, seed: int) -> tuple[Any, dict[str, Any], Any]:
    import torch

    from weightwire.torch_side.sender.engine import TorchTrainerEngine, tensor_bytes

    gen = torch.Generator(device="cuda").manual_seed(seed)
    tensors = {}
    for name, dtype, shape in spec:
        if dtype == "bool":
            tensors[name] = torch.randint(0, 2, shape, generator=gen, device="cuda").bool()
        elif dtype in ("int8", "uint8", "int32", "int64"):
            info = torch.iinfo(getattr(torch, dtype))
            tensors[name] = torch.randint(
                max(info.min, -1000),
                min(info.max, 1000),
                shape,
                generator=gen,
                device="cuda",
                dtype=getattr(torch, dtype),
            )
        elif dtype == "float64":
            tensors[name] = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float64)
        else:
            tensors[name] = torch.randn(shape, generator=gen, device="cuda").to(
                getattr(torch, dtype)
            )
    torch.cuda.synchronize()

    def sha(x: Any) -> str:
        return hashlib.sha256(tensor_bytes(x).cpu().numpy()).hexdigest()

    return TorchTrainerEngine, tensors, sha


def overlapped(engine: Any, tensors: dict[str, Any], spec: list, build: Any, r: int) -> Any:
    """One overlapped round: ``send_weights(wait=False)``, then the next step at once (every
    tensor written in place, after ``before_update``, then ~3 s more on the trainer's stream),
    then the wait. Returns the round's metrics and whether the step still ran when the round
    had ended (its reads did not queue behind the step)."""
    import torch

    fresh = build(spec, 100 + r)[1]  # made before the call: the step itself only writes
    handle = engine.send_weights(wait=False)
    engine.before_update()  # cow: what the round has not read is copied first
    for name, t in tensors.items():
        t.copy_(fresh[name])
    torch.cuda._sleep(5_000_000_000)  # ~2.5-3 s: longer than a first round with its set-up
    metrics = handle.result(timeout=300)
    running = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    return metrics, running


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--framework", choices=("jax", "torch"), required=True)
    ap.add_argument("--backend", default="weightwire_nccl")
    ap.add_argument("--packed", type=int, default=1)
    ap.add_argument("--buffer-mib", type=int, default=256)
    ap.add_argument("--num-buffers", type=int, default=2)
    ap.add_argument("--mib", type=int, default=1100)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--release", type=int, default=0, help="weightwire_ipc: free the slots after every round"
    )
    ap.add_argument(
        "--ipc-mode",
        choices=("pull", "push"),
        default="pull",
        help="weightwire_ipc: data path of packed rounds",
    )
    ap.add_argument(
        "--stop-at", type=int, default=-1, help="fault tests: tensor index of round 1 to stop at"
    )
    ap.add_argument("--stop", choices=("", "kill", "pause"), default="")
    ap.add_argument(
        "--overlap",
        choices=("", "copy", "cow"),
        default="",
        help="torch: send_weights(wait=False) with this snapshot, then the next step writes "
        "every tensor in place and keeps the trainer's stream busy (~3 s) before the wait",
    )
    args = ap.parse_args()
    spec = shapes(args.mib, args.framework)
    metas = [ParamMeta(n, d, s) for n, d, s in spec]
    build = jax_side if args.framework == "jax" else torch_side
    client = LoopbackClient(args.address, timeout=300)
    info = TrainerInitInfo(
        backend=args.backend,
        packed=bool(args.packed),
        device=0,
        packed_buffer_size_bytes=args.buffer_mib << 20,
        packed_num_buffers=args.num_buffers,
        timeouts=Timeouts(http_s=300, connect_s=120, warmup_s=60, transfer_s=120),
        ipc_release_after_round=bool(args.release),
        ipc_mode=args.ipc_mode,
        snapshot=args.overlap or "copy",
    )
    engine_cls, tensors, sha = build(spec, 0)
    source = Dict(tensors, metas, stop_at=args.stop_at, stop=args.stop)
    engine = engine_cls.trainer_init(info, client=client, source=source)
    rounds = []
    try:
        for r in range(args.rounds):
            if r and not args.overlap:  # overlapped: the step after each round wrote new values
                source.tensors = build(spec, r)[1]  # fresh values every round
                source.stop_at = -1
            start = time.perf_counter()
            step_running = None
            try:
                if args.overlap:
                    sent = {n: sha(t) for n, t in source.tensors.items()}
                    metrics, step_running = overlapped(engine, source.tensors, spec, build, r)
                else:
                    metrics = engine.send_weights()
            except Exception as exc:  # fault tests read the error the trainer got
                print(
                    json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}), flush=True
                )
                return 3
            wall = time.perf_counter() - start
            if not args.overlap:
                sent = {n: sha(t) for n, t in source.tensors.items()}
            (reply,) = client.weight_checker("checksum")
            bad = sorted(n for n, d in sent.items() if reply["checksums"].get(n) != d)
            held = getattr(engine.session.sender, "held_bytes", None)
            rounds.append(
                {
                    "trainer_extra": held() if held is not None else None,
                    "pipeline": type(engine.session.sender).__name__,
                    "version": metrics.version,
                    "nbytes": metrics.nbytes,
                    "chunks": metrics.chunks,
                    "gbps": metrics.gbps,
                    "wall_s": wall,
                    "seconds": metrics.seconds,
                    "reused_metadata": metrics.reused_metadata,
                    "mismatched": bad,
                    "receiver": client.stats(),
                    "weight_version": client.weight_info()[0]["weight_version"],
                    "digests": sent,
                    "step_running": step_running,
                }
            )
    finally:
        try:
            engine.shutdown()
        except (
            Exception
        ) as exc:  # after a failed round the server may be gone: the round's error was printed
            print(f"shutdown after the rounds failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    print(json.dumps({"ok": True, "tensors": len(spec), "rounds": rounds}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
