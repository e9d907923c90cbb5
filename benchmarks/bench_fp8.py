"""FP8 rounds against bf16 rounds of the same weights, in the same run.

    python benchmarks/bench_fp8.py --out fp8.md              # GPU: 8B shapes, ipc + tcp
    python benchmarks/bench_fp8.py --smoke                   # CPU: small shapes, tcp only

The trainer (``--engine torch`` or ``jax``) holds Llama-shaped bf16 weights (``N(0, 0.02)``,
``tests/torch_side/fake_llama.py``'s shapes) on its device. Per backend, two trainers in
turn against one loopback worker (``weightwire.testing.loopback``: it holds what it is sent):

- ``bf16`` rows: the weights as they are;
- ``fp8`` rows: ``fp8_source(source, spec)``, every linear of the decoder layers in block
  128x128 e4m3 with float32 ``weight_scale_inv`` (embedding, head and norms stay bf16), the
  quantization inside the round, on the trainer's device.

``weightwire_tcp`` runs through a link shaped in this benchmark (``shaped_link.py``,
``--rate-mb-s``, default 1250 = 10 GbE); ``weightwire_ipc`` (GPU) through CUDA IPC. Before
the rounds, the quantization alone: every FP8 weight quantized once against one dense device
copy of the same weights (median of ``--reps``), both per tensor (``quantize_fp8``) and as
the round runs it (``Fp8Source``: one launch per layer group; torch on a GPU: the fused
kernel, and again on torch ops, the "torch ops" row, ``WEIGHTWIRE_FP8_KERNEL=0``;
``--quantize-only`` stops there). Per row: seconds per round
(median of ``--rounds`` after ``--warmup``: the whole ``send_weights()``), wire bytes and, with
``--check`` (on with ``--smoke``), whether the worker holds the trainer's bytes. The issue's
targets (#51, one H200): wire bytes <= 0.52x bf16, quantization <= 1.5x one dense copy,
shaped-link round >= 1.8x faster.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.shaped_link import RelayedClient, ShapedLink  # noqa: E402

IPC, TCP = "weightwire_ipc", "weightwire_tcp"


@dataclass
class Row:
    backend: str
    kind: str  # "bf16" | "fp8"
    walls: list[float]
    wire_bytes: int
    link_bytes: int | None
    ok: bool | None  # None: not checked

    @property
    def round_s(self) -> float:
        return statistics.median(self.walls)


def weights(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from tests.torch_side.fake_llama import hf_shapes

    gen = torch.Generator(device=args.device).manual_seed(0)
    out = {}
    for name, shape in hf_shapes(args.shape).items():
        t = torch.empty(shape, dtype=torch.bfloat16, device=args.device)
        out[name] = t.normal_(0.0, 0.02, generator=gen)
    return out


def fp8_spec(tensors: dict[str, Any]) -> dict[str, Any]:
    from weightwire.shared.quant import Fp8Block

    return {n: Fp8Block() for n, t in tensors.items() if t.ndim == 2 and ".layers." in n}


def native(args: argparse.Namespace, tensors: dict[str, Any]) -> dict[str, Any]:
    """The engine's arrays: torch tensors, or JAX arrays sharing their memory (DLPack)."""
    if args.engine != "jax":
        return tensors
    import jax

    arrays = {n: jax.dlpack.from_dlpack(t) for n, t in tensors.items()}
    jax.block_until_ready(list(arrays.values()))
    return arrays


def quantize_cost(args: argparse.Namespace, arrays: dict[str, Any], spec: dict[str, Any]) -> dict:
    """Seconds to quantize every FP8 weight once, per tensor (``quantize_fp8``: one device
    read each) and as a round runs it (``Fp8Source``'s layer groups: one launch and one read
    per group), and to copy the same weights once."""
    from weightwire.tools.bench.sync_models import make_source

    if args.engine == "jax":
        import jax
        import jax.numpy as jnp

        from weightwire.jax_side.quant import fp8_source, quantize_fp8

        def sync(outs: list[Any]) -> None:
            jax.block_until_ready(outs)

        def quantize() -> None:
            outs = [quantize_fp8(n, arrays[n], s) for n, s in spec.items()]
            sync([(o.weight, o.scale) for o in outs])

        def copy() -> None:
            sync([jnp.copy(arrays[n]) for n in spec])

    else:
        import torch

        from weightwire.torch_side.sender.quant import fp8_source
        from weightwire.torch_side.sender.quant import quantize_fp8 as torch_quantize

        def sync(outs: list[Any]) -> None:
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()

        def quantize() -> None:
            for n, s in spec.items():
                torch_quantize(n, arrays[n], s)
            sync([])

        def copy() -> None:
            for n in spec:
                arrays[n].clone()
            sync([])

    fp8 = {n: a for n, a in arrays.items() if n in spec}
    source = fp8_source(make_source(fp8), spec)

    def grouped() -> None:
        sync([t for group in source.iter_groups() for _, t in group])

    def median(fn: Any) -> float:
        fn()  # compile / warm
        walls = []
        for _ in range(args.reps):
            start = time.perf_counter()
            fn()
            walls.append(time.perf_counter() - start)
        return statistics.median(walls)

    q, g, c = median(quantize), median(grouped), median(copy)
    cost = {"quantize_s": q, "grouped_s": g, "copy_s": c, "ratio": q / c, "grouped_ratio": g / c}
    if args.engine == "torch":
        cost["kernel"] = fused_kernel(args)
        # the same round's quantization on torch's eager ops (what runs without the kernel)
        before = os.environ.get("WEIGHTWIRE_FP8_KERNEL")
        os.environ["WEIGHTWIRE_FP8_KERNEL"] = "0"
        try:
            ops = median(grouped)
        finally:
            if before is None:
                del os.environ["WEIGHTWIRE_FP8_KERNEL"]
            else:
                os.environ["WEIGHTWIRE_FP8_KERNEL"] = before
        cost |= {"ops_s": ops, "ops_ratio": ops / c}
    return cost


def fused_kernel(args: argparse.Namespace) -> str:
    """Which path the torch engine's block weights take: the fused CUDA kernel, or torch ops
    (a CPU run, the switch off, or a kernel that did not compile: the log says why)."""
    if not args.device.startswith("cuda"):
        return "torch ops (cpu)"
    from weightwire.torch_side.sender import quant_cuda
    from weightwire.trainer import fp8_cuda

    if not quant_cuda.enabled():
        return "torch ops (WEIGHTWIRE_FP8_KERNEL=0)"
    index = int(args.device.split(":")[1]) if ":" in args.device else 0
    return "fused kernel" if fp8_cuda.kernels(index) is not None else "torch ops (no kernel)"


def expected_digests(args: argparse.Namespace, tensors: dict[str, Any], fp8: bool) -> dict:
    """What the worker must hold: each wire tensor's sha256 (FP8: torch's quantizer, which
    tests/interop holds bit-identical to vLLM's and to JAX's)."""
    from weightwire.shared.quant import fp8_names
    from weightwire.torch_side.sender.quant import quantize_fp8 as torch_quantize

    def sha(t: Any) -> str:
        flat = t.detach().contiguous().reshape(-1).view(__import__("torch").uint8).cpu()
        return hashlib.sha256(flat.numpy().data).hexdigest()

    spec = fp8_spec(tensors) if fp8 else {}
    out = {}
    for name, t in tensors.items():
        if name in spec:
            q = torch_quantize(name, t, spec[name])
            names = fp8_names(name, spec[name])
            out[names.weight], out[names.scale] = sha(q.weight), sha(q.scale)
        else:
            out[name] = sha(t)
    return out


def run_backend(args: argparse.Namespace, backend: str, tensors: dict[str, Any]) -> list[Row]:
    from weightwire.testing.loopback import spawn_loopback
    from weightwire.trainer import TrainerInitInfo

    engine: Any
    fp8_source: Any
    if args.engine == "jax":
        from weightwire.jax_side.engine import JAXTrainerEngine as engine
        from weightwire.jax_side.quant import fp8_source
    else:
        from weightwire.torch_side.sender.engine import TorchTrainerEngine as engine
        from weightwire.torch_side.sender.quant import fp8_source
    from weightwire.tools.bench.sync_models import make_source

    arrays = native(args, tensors)
    link = ShapedLink(args.rate_mb_s * 1e6) if backend == TCP else None
    proc, client = spawn_loopback(backend, args.device, timeout=300)
    if link is not None:
        client = RelayedClient(client.address, link)
    rows = []
    try:
        for kind in ("bf16", "fp8"):
            source = make_source(arrays)
            if kind == "fp8":
                source = fp8_source(source, fp8_spec(tensors))
            cuda = args.device.startswith("cuda")
            info = TrainerInitInfo(backend=backend, device=0 if cuda and backend == IPC else None)
            trainer = engine.trainer_init(info, client=client, source=source)
            walls, links, wire = [], [], 0
            try:
                for i in range(args.warmup + args.rounds):
                    sent = link.forwarded() if link else 0
                    start = time.perf_counter()
                    m = trainer.send_weights()
                    wall = time.perf_counter() - start
                    print(f"  {backend} {kind} round {i}: {wall:.3f} s, {m.summary()}", flush=True)
                    if i >= args.warmup:
                        walls.append(wall)
                        links.append(link.forwarded() - sent if link else 0)
                        wire = m.wire_bytes
            finally:
                trainer.shutdown()
            ok = None
            if args.check:
                (reply,) = client.weight_checker("checksum")
                want = expected_digests(args, tensors, kind == "fp8")
                ok = {n: reply["checksums"].get(n) for n in want} == want
            rows.append(
                Row(backend, kind, walls, wire, int(statistics.median(links)) if link else None, ok)
            )
    finally:
        client.exit()
        proc.wait(timeout=120)
        if link is not None:
            link.close()
    return rows


def table(rows: list[Row], cost: dict, rate: float) -> str:
    lines = [
        "| backend | weights | s/round (median) | x faster than bf16 | wire MB | x bf16 bytes "
        "| link GB/s | bytes |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    bf16 = {r.backend: r for r in rows if r.kind == "bf16"}
    for r in rows:
        base = bf16.get(r.backend, r)
        link = "-" if r.link_bytes is None else f"{r.link_bytes / r.round_s / 1e9:.2f}"
        ok = "-" if r.ok is None else ("ok" if r.ok else "MISMATCH")
        where = f" @ {rate / 1e9:g} GB/s" if r.link_bytes is not None else ""
        lines.append(
            f"| {r.backend}{where} | {r.kind} | {r.round_s:.3f} | {base.round_s / r.round_s:.2f}x "
            f"| {r.wire_bytes / 1e6:.1f} | {r.wire_bytes / base.wire_bytes:.3f} | {link} | {ok} |"
        )
    lines.append("\n" + quantize_table(cost))
    return "\n".join(lines)


def quantize_table(cost: dict) -> str:
    """The quantization rows: each path against one dense device copy of the same weights."""
    copy = cost["copy_s"]
    how = cost.get("kernel", "")
    rows = [
        "| quantization of every FP8 weight | ms | x one dense copy |",
        "|---|---:|---:|",
        f"| one dense device copy | {copy * 1e3:.1f} | 1.00x |",
        f"| as a round runs it ({how or 'one launch per layer group'}) "
        f"| {cost['grouped_s'] * 1e3:.1f} | {cost['grouped_ratio']:.2f}x |",
        f"| per tensor (quantize_fp8) | {cost['quantize_s'] * 1e3:.1f} | {cost['ratio']:.2f}x |",
    ]
    if "ops_s" in cost:
        rows.append(
            f"| torch ops (WEIGHTWIRE_FP8_KERNEL=0, as a round runs it) "
            f"| {cost['ops_s'] * 1e3:.1f} | {cost['ops_ratio']:.2f}x |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, small shapes, one round, checked")
    ap.add_argument("--device", default=None, help="cuda:0 when a GPU is there, else cpu")
    ap.add_argument("--shape", default=None, help="llama3-8b (GPU default), small, tiny")
    ap.add_argument("--backends", default=None, help="weightwire_ipc,weightwire_tcp (GPU)")
    ap.add_argument("--rate-mb-s", type=float, default=1250.0, help="the tcp link, MB/s")
    ap.add_argument("--engine", choices=["torch", "jax"], default="torch")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5, help="quantize / copy timings")
    ap.add_argument("--check", action="store_true", help="the worker holds the trainer's bytes")
    ap.add_argument(
        "--quantize-only", action="store_true", help="the quantization rows only, no rounds"
    )
    ap.add_argument("--out", help="the table (markdown); the rows as JSON beside it")
    args = ap.parse_args(argv)
    import torch

    if args.smoke:
        args.device, args.shape = args.device or "cpu", args.shape or "small"
        args.rounds, args.warmup, args.reps, args.check = 1, 0, 1, True
    args.device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    cuda = args.device.startswith("cuda")
    args.shape = args.shape or ("llama3-8b" if cuda else "small")
    backends = (args.backends or (f"{IPC},{TCP}" if cuda else TCP)).split(",")
    if IPC in backends and not cuda:
        ap.error(f"{IPC} needs a GPU (CUDA IPC); on a CPU run --backends {TCP}")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    tensors = weights(args)
    cost = quantize_cost(args, native(args, tensors), fp8_spec(tensors))
    print(f"quantize {cost}", flush=True)
    if args.quantize_only:
        text = quantize_table(cost)
        print(text, flush=True)
        if args.out:
            Path(args.out).write_text(text + "\n")
            Path(args.out).with_suffix(".json").write_text(json.dumps({"cost": cost}))
        return 0
    rows: list[Row] = []
    for backend in backends:
        rows += run_backend(args, backend, tensors)
    text = table(rows, cost, args.rate_mb_s * 1e6)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
        rows_json = [{**asdict(r), "round_s": r.round_s} for r in rows]
        Path(args.out).with_suffix(".json").write_text(
            json.dumps({"cost": cost, "rows": rows_json})
        )
    return 0 if all(r.ok is not False for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
