"""A MaxText-style pytree (scanned layers, head axes, layer axis in the middle) -> HF names -> vLLM.

Trainers like MaxText keep all decoder layers in one stacked tensor per parameter, with
the layer axis at position 1 (``param_scan_axis=1``) and attention kernels shaped
``[embed, layers, heads, head_dim]``. vLLM wants one unfused, HF-named tensor per layer.
A ``Naming`` states the mapping once, declaratively:

- ``Stacked(axis=1)``: the leaf holds every layer on axis 1; ``{layer}`` in the target.
- ``MergeAxes`` / ``Transpose``: heads merged, then ``[in, out]`` -> torch's ``[out, in]``.

``PytreeSource`` then yields ``model.layers.{i}.self_attn.q_proj.weight`` and friends,
sliced and transposed on device by jitted functions (compiled once, reused per layer).

This script builds such a pytree from an HF Llama checkpoint (the same mapping run
backwards), checks the forward mapping reproduces the checkpoint bit for bit, scales
every norm (a stand-in for a training step), sends the round, and, on the reference
server, checks the server's per-tensor sha256 against what was sent::

    weightwire serve --model tiny-llama --port 8000 &
    python examples/maxtext_style_scanned_layers.py --server http://127.0.0.1:8000 --model-dir DIR

(Real MaxText Llama checkpoints also permute q/k for its rotary layout; that is one more
``Reshape``/``Transpose`` in the q and k rules.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from weightwire import (
    HTTPWeightSyncClient,
    JAXTrainerEngine,
    MergeAxes,
    Naming,
    PytreeSource,
    Rule,
    Stacked,
    TrainerInitInfo,
    Transpose,
    pytree_from_hf,
    read_safetensors,
)

L = "decoder/layers"
HF = "model.layers.{layer}"
SCAN = Stacked(axis=1)  # MaxText's param_scan_axis
T = Transpose()

MAXTEXT_LLAMA = Naming(
    [
        Rule("token_embedder/embedding", "model.embed_tokens.weight"),
        Rule(f"{L}/pre_self_attention_layer_norm/scale", f"{HF}.input_layernorm.weight", SCAN),
        Rule(
            f"{L}/self_attention/query/kernel",
            f"{HF}.self_attn.q_proj.weight",
            SCAN,
            MergeAxes(1, 2),
            T,
        ),
        Rule(
            f"{L}/self_attention/key/kernel",
            f"{HF}.self_attn.k_proj.weight",
            SCAN,
            MergeAxes(1, 2),
            T,
        ),
        Rule(
            f"{L}/self_attention/value/kernel",
            f"{HF}.self_attn.v_proj.weight",
            SCAN,
            MergeAxes(1, 2),
            T,
        ),
        Rule(
            f"{L}/self_attention/out/kernel",
            f"{HF}.self_attn.o_proj.weight",
            SCAN,
            MergeAxes(0, 1),
            T,
        ),
        Rule(
            f"{L}/post_self_attention_layer_norm/scale",
            f"{HF}.post_attention_layernorm.weight",
            SCAN,
        ),
        Rule(f"{L}/mlp/wi_0/kernel", f"{HF}.mlp.gate_proj.weight", SCAN, T),
        Rule(f"{L}/mlp/wi_1/kernel", f"{HF}.mlp.up_proj.weight", SCAN, T),
        Rule(f"{L}/mlp/wo/kernel", f"{HF}.mlp.down_proj.weight", SCAN, T),
        Rule("decoder/decoder_norm/scale", "model.norm.weight"),
        Rule("decoder/logits_dense/kernel", "lm_head.weight", T),
    ],
    strip=("params",),
)


def maxtext_shapes(hf: dict) -> dict:
    """The MaxText pytree's structure (shapes only) for an HF Llama config."""
    e, n, v, m = (
        hf["hidden_size"],
        hf["num_hidden_layers"],
        hf["vocab_size"],
        hf["intermediate_size"],
    )
    h, kv = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    d = hf.get("head_dim") or e // h

    def s(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, jnp.float32)

    layers = {
        "pre_self_attention_layer_norm": {"scale": s(e, n)},
        "self_attention": {
            "query": {"kernel": s(e, n, h, d)},
            "key": {"kernel": s(e, n, kv, d)},
            "value": {"kernel": s(e, n, kv, d)},
            "out": {"kernel": s(h, n, d, e)},
        },
        "post_self_attention_layer_norm": {"scale": s(e, n)},
        "mlp": {
            "wi_0": {"kernel": s(e, n, m)},
            "wi_1": {"kernel": s(e, n, m)},
            "wo": {"kernel": s(m, n, e)},
        },
    }
    return {
        "params": {
            "token_embedder": {"embedding": s(v, e)},
            "decoder": {
                "layers": layers,
                "decoder_norm": {"scale": s(e)},
                "logits_dense": {"kernel": s(e, v)},
            },
        }
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", required=True)
    ap.add_argument(
        "--model-dir", required=True, help="an HF Llama directory (the one the server loaded)"
    )
    ap.add_argument(
        "--backend", default="weightwire_tcp", choices=("nccl", "weightwire_nccl", "weightwire_tcp")
    )
    args = ap.parse_args(argv)

    hf_config = json.loads((Path(args.model_dir) / "config.json").read_text())
    checkpoint = read_safetensors(args.model_dir)
    params = pytree_from_hf(MAXTEXT_LLAMA, maxtext_shapes(hf_config), checkpoint)
    print(
        "pytree leaves:",
        {
            "/".join(str(k.key) for k in path): tuple(x.shape)
            for path, x in jax.tree_util.tree_flatten_with_path(params)[0][:4]
        },
        "...",
    )

    live = {"params": params}
    source = PytreeSource(lambda: live["params"], MAXTEXT_LLAMA)
    for name, array in source:  # the forward mapping reproduces the checkpoint exactly
        if not np.array_equal(np.asarray(array), checkpoint[name]):
            raise SystemExit(f"mapping error: {name} differs from the checkpoint")
    print(f"mapping ok: {len(source.metadata())} HF tensors reproduce the checkpoint bit for bit")

    # A stand-in for a training step: scale every norm.
    live["params"] = jax.tree_util.tree_map_with_path(
        lambda path, x: x * 1.5 if "norm" in jax.tree_util.keystr(path) else x, params
    )
    # ready_timeout: a server started beside this script may still be loading (vLLM: minutes).
    client = HTTPWeightSyncClient(args.server, timeout=300, ready_timeout=600)
    engine = JAXTrainerEngine.trainer_init(
        TrainerInitInfo(backend=args.backend), client=client, source=source
    )
    try:
        m = engine.send_weights(weight_version="maxtext-1")
        print(
            f"sent {m.tensors} tensors, {m.nbytes / 1e6:.2f} MB in {m.total_seconds * 1e3:.1f} ms"
        )
        if "+weightwire" in client.version():  # the reference server checksums HF-named tensors
            served = client.weight_checker("checksum")[0]["checksums"]
            sent = {
                n: hashlib.sha256(np.ascontiguousarray(np.asarray(a)).tobytes()).hexdigest()
                for n, a in source
            }
            wrong = sorted(n for n in sent if served.get(n) != sent[n])
            if wrong:
                raise SystemExit(f"server holds different bytes for {wrong[:4]}")
            print(f"server checksums match all {len(sent)} tensors sent")
    finally:
        engine.shutdown()
        client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
