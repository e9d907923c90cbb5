"""Every family of the model matrix against a real vLLM: 3 JAX rounds and 1 torch round.

After each round vLLM's greedy completion (ids and logprobs) must equal Hugging Face's
on the weights just sent, and differ from the previous round's (so the round changed
what vLLM computes: a stale layer, e.g. a tied head keeping the checkpoint's embedding,
fails here). Each model ends with its checkpoint's weights restored.
"""

from __future__ import annotations

import pytest
import torch

from tests.interop.conftest import serve
from tests.interop.helpers import VLLMServer, assert_same_greedy
from tests.interop.launcher import Launcher
from tests.interop.models import MATRIX, hf_model, jax_params, load_into_hf, perturbed, scale_for
from weightwire.control.client import HTTPWeightSyncClient
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.jax_side.source import PytreeSource
from weightwire.torch_side.sender.engine import TorchTrainerEngine
from weightwire.torch_side.sender.source import ModuleSource
from weightwire.trainer.config import TrainerInitInfo

pytestmark = [pytest.mark.interop, pytest.mark.timeout(900)]


@pytest.fixture(scope="module", params=MATRIX)
def model_server(
    request: pytest.FixtureRequest,
    launcher: Launcher,
    model_dirs: dict[str, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> VLLMServer:
    return serve(launcher, model_dirs, request.param, tmp_path_factory.getbasetemp() / "models")


def test_three_jax_rounds_then_one_torch_round_match_hugging_face(model_server: VLLMServer) -> None:
    server = model_server
    hf = hf_model(server.model_dir)
    original = assert_same_greedy(server, hf, "checkpoint, before any round")
    params0, naming = jax_params(server.model_dir)
    live = {"params": params0}
    source = PytreeSource(lambda: live["params"], naming)
    client = HTTPWeightSyncClient(server.url, timeout=120)
    # A 16 KiB packing buffer splits the model into many broadcasts; pause_mode="keep"
    # explicitly until the coordinator's default change lands on main.
    info = TrainerInitInfo(
        backend="weightwire_tcp", packed_buffer_size_bytes=16 << 10, pause_mode="keep"
    )
    engine = JAXTrainerEngine.trainer_init(info, client=client, source=source)
    previous = original
    scale = scale_for(server.model_dir)
    try:
        for r in (1, 2, 3):
            live["params"] = perturbed(params0, seed=r, scale=scale)
            metrics = engine.send_weights(weight_version=f"jax-{r}")
            assert metrics.chunks > 1 and metrics.tensors == len(source.metadata())
            assert server.weight_version() == f"jax-{r}"
            load_into_hf(hf, source)
            tokens = assert_same_greedy(server, hf, f"JAX round {r}")
            assert tokens != previous, f"JAX round {r} did not change vLLM's greedy output"
            previous = tokens
    finally:
        engine.shutdown()
    torch_engine = TorchTrainerEngine.trainer_init(
        TrainerInitInfo(backend="weightwire_tcp", pause_mode="keep"),
        client=client,
        source=ModuleSource(hf),
    )
    try:
        gen = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(scale * torch.randn(p.shape, generator=gen))
        torch_engine.send_weights(weight_version="torch-1")
        assert server.weight_version() == "torch-1"
        tokens = assert_same_greedy(server, hf, "torch round")
        assert tokens != previous, "the torch round did not change vLLM's greedy output"
        pristine = hf_model(server.model_dir)
        hf.load_state_dict(pristine.state_dict())
        torch_engine.send_weights(weight_version="checkpoint")
        assert assert_same_greedy(server, pristine, "checkpoint restored") == original
    finally:
        torch_engine.shutdown()
        client.close()
