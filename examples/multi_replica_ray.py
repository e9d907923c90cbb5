"""One JAX trainer, several inference replicas, one weight sync per step.

Ray (GPUs): each replica is a ``vllm.LLM`` in a Ray actor on its own GPU; the trainer
drives them all through ``RayWeightSyncClient`` with one NCCL group (trainer rank 0,
replica ``i`` at rank ``1 + i * tp``)::

    pip install -e ".[jax,ray,cuda12]" vllm     # from this repository's checkout
    python examples/multi_replica_ray.py --ray --model ./qwen2.5-0.5b --replicas 2

HTTP (any host): the same with running servers, one URL per replica (each may itself
hold several ranks, e.g. ``weightwire serve --replicas 2``); ``HTTPWeightSyncClient``
shifts each server's ``rank_offset`` by the world sizes before it::

    weightwire serve --model tiny-llama --port 8001 --replicas 2 &
    weightwire serve --model tiny-llama --port 8002 &
    python examples/multi_replica_ray.py --urls http://127.0.0.1:8001 http://127.0.0.1:8002 \\
        --model-dir DIR --backend weightwire_tcp

Either way, each step perturbs the JAX model (a stand-in for training), sends it once to
every replica, and checks each replica reports the new version and generates with
exactly the JAX model's log-probabilities.
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import numpy as np
from _score import logprob_gap

from weightwire import (
    HTTPWeightSyncClient,
    JAXTrainerEngine,
    PytreeSource,
    RayWeightSyncClient,
    TrainerInitInfo,
    load_decoder,
)
from weightwire.tools.models import decoder

PROMPT = np.asarray([5, 17, 42, 99, 123, 7], np.int32)


def perturb(params: Any, seed: int, scale: float = 0.02) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree_util.tree_unflatten(
        treedef,
        [
            x + scale * jax.random.normal(k, x.shape, x.dtype)
            for x, k in zip(leaves, keys, strict=True)
        ],
    )


def ray_replicas(model: str, replicas: int, tp: int) -> tuple[Any, list[Any]]:
    """``vllm.LLM`` actors with the NCCL weight-transfer backend, and a client over them."""
    import ray
    import vllm
    from vllm import LLM

    ray.init(ignore_reinit_error=True)
    actor = ray.remote(num_gpus=tp)(LLM)
    handles = [
        actor.remote(
            model=model,
            tensor_parallel_size=tp,
            enforce_eager=True,
            gpu_memory_utilization=0.5,
            weight_transfer_config={"backend": "nccl"},
        )
        for _ in range(replicas)
    ]
    client = RayWeightSyncClient(handles, world_sizes=tp, server_version=vllm.__version__)
    return client, handles


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--urls", nargs="+", help="running servers, one per replica")
    mode.add_argument(
        "--ray", action="store_true", help="start vllm.LLM replicas as Ray actors (GPUs)"
    )
    ap.add_argument("--model-dir", help="the HF directory the servers loaded (--urls)")
    ap.add_argument("--model", help="--ray: the model directory each replica loads")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument(
        "--backend", default="nccl", choices=("nccl", "weightwire_nccl", "weightwire_tcp")
    )
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)

    model_dir = args.model if args.ray else args.model_dir
    if not model_dir:
        ap.error("--urls needs --model-dir, --ray needs --model")
    cfg, params0 = load_decoder(model_dir)
    if args.ray:
        client, _handles = ray_replicas(model_dir, args.replicas, args.tp)
        urls: list[
            str
        ] = []  # vllm.LLM actors serve no HTTP: versions are checked, log-probs are not
    else:
        # ready_timeout: replicas started beside this script may still be loading.
        client = HTTPWeightSyncClient(args.urls, timeout=300, ready_timeout=600)
        urls = args.urls
    live = {"params": params0}
    source = PytreeSource(lambda: live["params"], decoder.naming(cfg))
    on_gpu = args.backend != "weightwire_tcp"
    engine = JAXTrainerEngine.trainer_init(
        TrainerInitInfo(backend=args.backend, device=0 if on_gpu else None),
        client=client,
        source=source,
    )
    print(f"one group: trainer + {client.get_world_size()} inference ranks")
    try:
        for step in range(1, args.steps + 1):
            live["params"] = perturb(params0, seed=step)
            m = engine.send_weights(weight_version=f"step-{step}")
            versions = [info["weight_version"] for info in client.weight_info()]
            diffs = [logprob_gap(url, live["params"], cfg, PROMPT) for url in urls]
            ok = all(v == f"step-{step}" for v in versions) and all(d < 1e-3 for d in diffs)
            print(
                f"step {step}: sync {m.total_seconds * 1e3:.1f} ms, versions {versions}, max "
                f"|dlogp| per replica {[f'{d:.1e}' for d in diffs]} "
                f"{'ok' if ok else 'MISMATCH'}",
                flush=True,
            )
            if not ok:
                return 1
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
