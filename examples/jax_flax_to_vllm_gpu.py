"""A JAX (Flax) trainer on one GPU pushes its weights into a *stock* vLLM on another, over NCCL.

No torch on the trainer: weightwire mints the NCCL unique id with cupy, joins vLLM's
workers as rank 0, and broadcasts JAX arrays straight from device memory.

Server (GPU 1), any vLLM >= 0.30 (the ``nccl_unique_id_b64`` rendezvous)::

    huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir ./qwen2.5-0.5b
    CUDA_VISIBLE_DEVICES=1 VLLM_SERVER_DEV_MODE=1 vllm serve ./qwen2.5-0.5b --port 8000 \\
        --weight-transfer-config '{"backend": "nccl"}' --gpu-memory-utilization 0.5

Trainer (GPU 0); cupy's NCCL must be the version vLLM's torch loads
(``python -c "import torch; print(torch.cuda.nccl.version())"`` there;
``weightwire doctor URL`` here; step by step, versions pinned: ``docs/gpu-vllm.md``)::

    pip install -e ".[jax,cuda12]" 'jax[cuda12]'     # from this repository's checkout
    CUDA_VISIBLE_DEVICES=0 XLA_PYTHON_CLIENT_PREALLOCATE=false \\
        python examples/jax_flax_to_vllm_gpu.py \\
        --server http://127.0.0.1:8000 --model-dir ./qwen2.5-0.5b

What happens: the checkpoint is loaded into a Flax model (the Qwen2 preset run backwards),
then each step trains next-token prediction on one sentence and calls ``send_weights()``,
which pushes every tensor (bf16, packed into 1 GiB NCCL broadcasts). The server's greedy
completion of the sentence, scored by the JAX model, shows the two sides agree.

CPU-only machines: run against the reference server (``weightwire serve --model tiny-llama``)
or a vLLM with the weightwire plugin, with ``--backend weightwire_tcp --dtype float32``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _score import logprob_gap, token_logprobs
from tokenizers import Tokenizer

from weightwire import (
    HTTPWeightSyncClient,
    JAXTrainerEngine,
    PytreeSource,
    TrainerInitInfo,
    load_decoder,
)
from weightwire.tools.models import decoder

SENTENCE = "The trainer sends fresh weights to the inference server after every step."


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", required=True, help="vLLM base URL")
    ap.add_argument("--model-dir", required=True, help="the HF directory the server loaded")
    ap.add_argument(
        "--backend", default="nccl", choices=("nccl", "weightwire_nccl", "weightwire_tcp")
    )
    ap.add_argument(
        "--dtype", default="bfloat16", help="parameter and wire dtype (bfloat16 / float32)"
    )
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-4)
    args = ap.parse_args(argv)

    cfg, params = load_decoder(args.model_dir, dtype=args.dtype, param_dtype=args.dtype)
    tokens = Tokenizer.from_file(str(Path(args.model_dir) / "tokenizer.json")).encode(SENTENCE).ids
    seq = jnp.asarray([tokens], jnp.int32)
    opt = optax.adam(args.lr)
    state = {"params": params, "opt": opt.init(params)}

    @jax.jit
    def train_step(params, opt_state):
        def loss_fn(p):
            return -jnp.mean(token_logprobs(p, seq, cfg))

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    # ready_timeout: a server started beside this script may still be loading (vLLM: minutes).
    client = HTTPWeightSyncClient(args.server, timeout=300, ready_timeout=600)
    # The source reads the live params each round: no copy, no host round trip on GPU.
    source = PytreeSource(lambda: state["params"], decoder.naming(cfg), dtype=args.dtype)
    on_gpu = args.backend != "weightwire_tcp"
    engine = JAXTrainerEngine.trainer_init(
        TrainerInitInfo(backend=args.backend, device=0 if on_gpu else None),
        client=client,
        source=source,
    )
    prompt = np.asarray(tokens[:4], np.int32)
    try:
        for step in range(1, args.steps + 1):
            state["params"], state["opt"], loss = train_step(state["params"], state["opt"])
            m = engine.send_weights(weight_version=f"step-{step}")
            diff = logprob_gap(args.server, state["params"], cfg, prompt)
            print(
                f"step {step}: loss {float(loss):.4f}  sync {m.total_seconds * 1e3:.1f} ms  "
                f"{m.nbytes / 1e6:.1f} MB  {m.gbps:.2f} GB/s  server vs JAX max |dlogp| {diff:.2e}",
                flush=True,
            )
    finally:
        engine.shutdown()
        client.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
