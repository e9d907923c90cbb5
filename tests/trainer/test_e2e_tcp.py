"""CPU end to end: JAX and torch trainer engines -> the reference server (2 worker
replicas, separate processes) over weightwire_tcp. Three rounds of changing weights;
after each, every replica holds the sent bytes exactly and reports the version."""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np
import pytest

from weightwire.control import HTTPWeightSyncClient
from weightwire.shared.timeouts import Timeouts
from weightwire.trainer import TrainerInitInfo

TIMEOUTS = Timeouts(http_s=120, connect_s=60, warmup_s=60, transfer_s=60)


def model_dir() -> str:
    from weightwire.tools.server.tiny import resolve_model

    return resolve_model("tiny-llama")


def replica_checksums(client: HTTPWeightSyncClient) -> list[dict[str, str]]:
    (reply,) = client.weight_checker("checksum")
    replicas = reply["replica_checksums"]
    assert len(replicas) == 2 and replicas[0] == reply["checksums"]
    return replicas


def run_rounds(client: HTTPWeightSyncClient, engine: Any, perturb: Any, digests: Any) -> None:
    try:
        for step in (1, 2, 3):
            before = replica_checksums(client)[0]
            perturb(step)
            metrics = engine.send_weights()  # verify=True: the engine checked every replica too
            want = digests()
            assert metrics.version == str(step) and metrics.reused_metadata == (step > 1)
            assert metrics.nbytes > 0 and metrics.chunks >= 1
            for replica in replica_checksums(client):
                assert {n: replica.get(n) for n in want} == want
            assert all(
                before[n] != d for n, d in want.items()
            )  # every tensor really changed this round
            assert client.weight_info()[0]["weight_version"] == str(step)
    finally:
        engine.shutdown()


def jax_pytree_source() -> tuple[Any, Any]:
    """The Flax llama built from the tiny-llama config.json, exported by PytreeSource."""
    import json

    import jax

    from weightwire.jax_side.source import PytreeSource
    from weightwire.tools.models import llama

    with open(os.path.join(model_dir(), "config.json")) as f:
        cfg = llama.LlamaConfig.from_hf_config(json.load(f))
    state = {"params": llama.init(jax.random.key(0), cfg)}
    noise = jax.tree.map(
        lambda x: jax.random.normal(jax.random.key(1), x.shape, x.dtype), state["params"]
    )

    def perturb(step: int) -> None:
        state["params"] = jax.tree.map(lambda x, n: x + (1e-3 * step) * n, state["params"], noise)

    return PytreeSource(lambda: state["params"], llama.naming(cfg)), perturb


def jax_dict_source() -> tuple[Any, Any]:
    """HF-named jnp arrays loaded from the tiny-llama safetensors."""
    import jax
    import jax.numpy as jnp
    from safetensors.numpy import load_file

    from tests.trainer.fakes import DictSource
    from weightwire.jax_side.dtypes import describe

    params = {
        k: jnp.asarray(v)
        for k, v in load_file(os.path.join(model_dir(), "model.safetensors")).items()
    }
    key = jax.random.PRNGKey(0)
    noise = {
        k: jax.random.normal(jax.random.fold_in(key, i), v.shape, v.dtype)
        for i, (k, v) in enumerate(params.items())
    }

    def perturb(step: int) -> None:
        for k in params:
            params[k] = params[k] + jnp.asarray(1e-3 * step, params[k].dtype) * noise[k]

    return DictSource(params, describe), perturb


@pytest.mark.parametrize(
    ("make_source", "packed"),
    [(jax_pytree_source, True), (jax_dict_source, False)],
    ids=["pytree-packed", "dict-unpacked"],
)
def test_jax_engine_rounds_over_tcp(server_url: str, make_source: Any, packed: bool) -> None:
    from weightwire.jax_side.engine import JAXTrainerEngine

    source, perturb = make_source()

    def digests() -> dict[str, str]:  # what the source yields now, i.e. what must have arrived
        return {k: hashlib.sha256(np.asarray(v).tobytes()).hexdigest() for k, v in source}

    client = HTTPWeightSyncClient(server_url, timeout=120)
    info = TrainerInitInfo(
        backend="weightwire_tcp",
        packed=packed,
        packed_buffer_size_bytes=64 << 10,
        verify=True,
        pause_mode="keep",
        timeouts=TIMEOUTS,
    )
    engine = JAXTrainerEngine.trainer_init(info, client=client, source=source)
    run_rounds(client, engine, perturb, digests)


def test_torch_engine_rounds_over_tcp(server_url: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from weightwire.torch_side.sender.engine import TorchTrainerEngine, tensor_bytes
    from weightwire.torch_side.sender.source import ModuleSource

    model = AutoModelForCausalLM.from_pretrained(model_dir(), dtype=torch.float32)
    source = ModuleSource(model)
    gen = torch.Generator().manual_seed(0)
    noise = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}

    @torch.no_grad()
    def perturb(step: int) -> None:
        for n, p in model.named_parameters():
            p.add_(noise[n], alpha=1e-3 * step)

    def digests() -> dict[str, str]:
        return {n: hashlib.sha256(tensor_bytes(t).numpy()).hexdigest() for n, t in source}

    client = HTTPWeightSyncClient(server_url, timeout=120)
    info = TrainerInitInfo(
        backend="weightwire_tcp", packed_buffer_size_bytes=32 << 10, verify=True, timeouts=TIMEOUTS
    )
    engine = TorchTrainerEngine.trainer_init(info, client=client, source=source)
    run_rounds(client, engine, perturb, digests)
