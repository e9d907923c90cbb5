"""An adapter round next to a dense round of the same model, end to end, same run.

    python benchmarks/bench_lora.py [--shape 0.5b|8b] [--rank 16] [--rounds 5]
        [--device cpu|cuda] [--backend weightwire_tcp]

Builds a model directory of the shape (Qwen2-0.5B: 24 layers, hidden 896; Llama-3-8B: 32
layers, hidden 4096; bfloat16, zero weights: only bytes and shapes matter here), starts
the reference server on it (``weightwire serve --enable-lora``, one replica), and from a
JAX trainer in this process runs:

- ``dense``: ``--rounds`` rounds of every base tensor (``PytreeSource`` over the
  checkpoint, the model's own naming);
- ``adapter``: the adapter's registration (the trainer writes its PEFT directory once, the
  server loads it), then ``--rounds`` adapter rounds of a rank ``--rank`` adapter on every
  attention and MLP projection (q, k, v, o, gate, up, down), changed before each round.

Each round is one ``send_weights`` (start, transfer, finish: the server's workers stage
it and swap it in at finish); the table gives the median wall time per round, its bytes and
the phase split of the median round. The 8B shape needs ~16 GB for its checkpoint, as much
again in the server, and the trainer's copy: a GPU host (``--device cuda``) or a large box.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": {  # Qwen2-0.5B
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "bias": True,
    },
    "8b": {  # Llama-3-8B
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "bias": False,
    },
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _projection_shapes(s: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """``{block/proj: (in, out)}`` of one decoder layer."""
    h, i, d = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    q, kv = s["num_attention_heads"] * d, s["num_key_value_heads"] * d
    return {
        "self_attn/q_proj": (h, q),
        "self_attn/k_proj": (h, kv),
        "self_attn/v_proj": (h, kv),
        "self_attn/o_proj": (q, h),
        "mlp/gate_proj": (h, i),
        "mlp/up_proj": (h, i),
        "mlp/down_proj": (i, h),
    }


def build_model(shape: str, out: Path) -> Path:
    """A checkpoint of ``shape`` (zeros, bfloat16) with the tiny Llama's tokenizer."""
    from weightwire.shared.lora import write_safetensors
    from weightwire.tools.server.tiny import tiny_model_dir

    s = SHAPES[shape]
    bf16 = ml_dtypes.bfloat16
    h = s["hidden_size"]
    tensors: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": np.zeros((s["vocab_size"], h), bf16)
    }
    for layer in range(s["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        tensors[f"{p}.input_layernorm.weight"] = np.ones(h, bf16)
        tensors[f"{p}.post_attention_layernorm.weight"] = np.ones(h, bf16)
        for path, (fin, fout) in _projection_shapes(s).items():
            name = f"{p}.{path.replace('/', '.')}"
            tensors[f"{name}.weight"] = np.zeros((fout, fin), bf16)
            if s["bias"] and path.split("/")[1] in ("q_proj", "k_proj", "v_proj"):
                tensors[f"{name}.bias"] = np.zeros(fout, bf16)
    tensors["model.norm.weight"] = np.ones(h, bf16)
    if not s["tie_word_embeddings"]:
        tensors["lm_head.weight"] = np.zeros((s["vocab_size"], h), bf16)
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(out / "model.safetensors", tensors)
    config = {k: v for k, v in s.items() if k != "bias"}
    config.update(
        {
            "hidden_act": "silu",
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "torch_dtype": "bfloat16",
            "dtype": "bfloat16",
            "bos_token_id": 0,
            "eos_token_id": 1,
        }
    )
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tiny = Path(tiny_model_dir("tiny-llama"))
    for f in tiny.iterdir():
        if "token" in f.name or f.name == "special_tokens_map.json":
            shutil.copy2(f, out / f.name)
    return out


def adapter_tree(shape: str, rank: int, seed: int) -> dict[str, Any]:
    """A rank-``rank`` adapter on every projection of every layer (float32 in, bf16 out)."""
    s = SHAPES[shape]
    rng = np.random.default_rng(seed)
    layers = []
    for _ in range(s["num_hidden_layers"]):
        layer: dict[str, dict[str, dict[str, np.ndarray]]] = {"self_attn": {}, "mlp": {}}
        for path, (fin, fout) in _projection_shapes(s).items():
            block, proj = path.split("/")
            layer[block][proj] = {
                "lora_a": (0.01 * rng.standard_normal((fin, rank))).astype(ml_dtypes.bfloat16),
                "lora_b": (0.01 * rng.standard_normal((rank, fout))).astype(ml_dtypes.bfloat16),
            }
        layers.append(layer)
    return {"model": {"layers": layers}}


def start_server(
    model_dir: Path, args: argparse.Namespace, log: Path
) -> tuple[subprocess.Popen[str], str]:
    from weightwire.tools.demo.server import ReadyLine

    cmd = [
        sys.executable,
        "-m",
        "weightwire.tools.server",
        "--model",
        str(model_dir),
        "--port",
        "0",
    ]
    cmd += ["--device", args.device, "--backend", args.backend, "--enable-lora"]
    cmd += ["--max-lora-rank", str(args.rank), "--startup-timeout", "1800"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    ready = ReadyLine(proc)
    if not ready.wait(1800) or ready.url is None:
        proc.kill()
        raise SystemExit(f"server did not start; log:\n{log.read_text()[-3000:]}")
    return proc, ready.url


def timed_rounds(send: Any, rounds: int, before: Any = None) -> list[Any]:
    out = []
    for r in range(rounds):
        if before is not None:
            before(r)
        started = time.perf_counter()
        metrics = send()
        out.append((time.perf_counter() - started, metrics))
    return out


def summary(label: str, runs: list[Any]) -> dict[str, Any]:
    wall = [w for w, _ in runs]
    median = sorted(runs, key=lambda x: x[0])[len(runs) // 2][1]
    return {
        "round": label,
        "median_s": statistics.median(wall),
        "min_s": min(wall),
        "tensors": median.tensors,
        "MB": median.nbytes / 1e6,
        "phases": {k: round(v, 4) for k, v in median.seconds.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="weightwire_tcp")
    p.add_argument("--workdir", default=None, help="keep the model and logs here")
    args = p.parse_args()
    # The server shares the GPU: JAX must take memory as it needs it, not grab 75 % of the
    # device up front (its default), nor cap itself at a fraction the server already holds.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")
    import jax

    from weightwire.control.client import HTTPWeightSyncClient
    from weightwire.jax_side.checkpoint import read_hf_config
    from weightwire.jax_side.engine import JAXTrainerEngine
    from weightwire.jax_side.lora import lora_source
    from weightwire.jax_side.source import PytreeSource
    from weightwire.tools.models import decoder
    from weightwire.trainer.config import TrainerInitInfo
    from weightwire.trainer.lora import AdapterSync

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-lora-"))
    t0 = time.perf_counter()
    model_dir = build_model(args.shape, work / f"model-{args.shape}")
    print(f"built {args.shape} checkpoint in {time.perf_counter() - t0:.1f} s: {model_dir}")
    proc, url = start_server(model_dir, args, work / "server.log")
    client = HTTPWeightSyncClient(url, timeout=1800)
    info = TrainerInitInfo(backend=args.backend)
    results = []
    try:
        # The trainer's parameters as the model initializes them (zeros, like the checkpoint;
        # only shapes and bytes matter): loading the checkpoint through its inverse naming holds
        # several copies of an 8B model at once, more than the GPU has beside the server's.
        cfg = decoder.DecoderConfig.from_hf_config(read_hf_config(model_dir))
        abstract = jax.eval_shape(lambda: decoder.init(jax.random.key(0), cfg))
        params = jax.tree.map(lambda a: jax.numpy.zeros(a.shape, a.dtype), abstract)
        dense = JAXTrainerEngine.trainer_init(
            info, client=client, source=PytreeSource(params, decoder.naming(cfg), dtype="bfloat16")
        )
        try:
            dense.send_weights()  # warm: the first round plans and connects
            results.append(summary("dense", timed_rounds(dense.send_weights, args.rounds)))
        finally:
            dense.shutdown()
        del params
        live = {"tree": adapter_tree(args.shape, args.rank, 0)}
        engine = JAXTrainerEngine.trainer_init(
            info, client=client, source=lora_source(lambda: live["tree"], "bench")
        )
        try:
            sync = AdapterSync(engine, "bench", alpha=2.0 * args.rank, adapter_dir=work / "adapter")
            started = time.perf_counter()
            sync.register()
            registration = time.perf_counter() - started
            sync.send()  # warm

            def change(r: int) -> None:
                live["tree"] = adapter_tree(args.shape, args.rank, r + 1)

            runs = timed_rounds(sync.send, args.rounds, before=change)
            results.append(summary(f"adapter r={args.rank}", runs))
        finally:
            engine.shutdown()
    finally:
        client.close()
        proc.terminate()
        proc.wait(60)
    where = f"{args.backend} on {args.device}"
    print(f"\n{args.shape}, {where}, {args.rounds} rounds, jax {jax.__version__}")
    print(f"adapter registration (PEFT directory written + loaded once): {registration:.3f} s")
    print(
        f"{'round':<14}{'median s':>10}{'min s':>10}{'tensors':>9}{'MB':>10}  phases of the median"
    )
    for r in results:
        print(
            f"{r['round']:<14}{r['median_s']:>10.3f}{r['min_s']:>10.3f}{r['tensors']:>9}"
            f"{r['MB']:>10.1f}  {r['phases']}"
        )
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
