"""Runs in the interop venv (it has vLLM): vLLM's own trainer-side objects driving our engine.

``python _vllm_api_trainer.py URL MODEL_DIR`` builds the checkpoint's HF model, wraps it
in vLLM's ``ModuleSource`` and talks through vLLM's ``HTTPVLLMWeightSyncClient``, with
no version or world-size hints: the engine must take both as they are. One perturbed
round, then the original weights again; after each, vLLM's greedy output must equal
Hugging Face's on the same weights. Prints ``OK <changed tokens>`` on success.
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM
from vllm.distributed.weight_transfer.base import ModuleSource
from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

from tests.interop.helpers import VLLMServer, assert_same_greedy
from weightwire.torch_side.sender.engine import TorchTrainerEngine
from weightwire.trainer.config import TrainerInitInfo


def main(url: str, model_dir: str) -> None:
    server = VLLMServer(url, model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    original = assert_same_greedy(server, hf, "before the vLLM-API round")
    pristine = {k: v.clone() for k, v in hf.state_dict().items()}
    engine = TorchTrainerEngine.trainer_init(
        TrainerInitInfo(backend="weightwire_tcp"),
        client=HTTPVLLMWeightSyncClient(url, timeout=120),
        source=ModuleSource(hf),
    )
    try:
        gen = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        engine.send_weights(weight_version="vllm-api-1")
        assert server.weight_version() == "vllm-api-1"
        changed = assert_same_greedy(server, hf, "vLLM-API round")
        assert changed != original, "the round did not change vLLM's output"
        hf.load_state_dict(pristine)
        engine.send_weights(weight_version="vllm-api-restored")
        assert assert_same_greedy(server, hf, "vLLM-API restored") == original
    finally:
        engine.shutdown()
    print("OK", changed[0][:4])


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
