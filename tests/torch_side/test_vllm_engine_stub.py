"""vLLM's weightwire engine class (``VllmWeightwireTCPEngine``) over fake vLLM reload hooks
(``tests.torch_side.vllm_stub``), in its own process, fed by a ``TorchTrainerEngine``:
both strategies land every byte in vLLM's fused layout; a round that fails after its first
in-place write leaves the engine reporting an incomplete round, never one that fails staged;
the next complete round clears it. (``tests/gpu/test_vllm_stub_ipc_gpu.py`` runs the IPC
engine the same way with an 8B-shaped round and measures its memory.)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.torch_side._procs import spawn_stub
from tests.torch_side.fake_llama import digest, hf_shapes, trainer_tensors
from weightwire.shared.meta import ParamMeta
from weightwire.shared.source import WeightSource
from weightwire.testing.loopback import LoopbackClient
from weightwire.torch_side.dtypes import wire_name
from weightwire.trainer import TrainerInitInfo

pytestmark = pytest.mark.timeout(120)
BUDGETS = {"staged": 1 << 30, "streaming": 0}


class RoundSource(WeightSource):
    """``trainer_tensors`` of one seed; ``fail_at``: raise before yielding that tensor."""

    def __init__(self, shape: str, device: torch.device) -> None:
        self.shape, self.device, self.seed, self.fail_at = shape, device, 0, None
        self.tensors: dict[str, torch.Tensor] = {}

    def reseed(self, seed: int) -> dict[str, list[int]]:
        self.seed = seed
        self.tensors = {}  # the old set goes first: two 8B sets and a staged pool pass 80 GB
        self.tensors = dict(trainer_tensors(self.shape, self.device, seed))
        return {n: digest(t) for n, t in self.tensors.items()}

    def metadata(self) -> list[ParamMeta]:
        return [
            ParamMeta(n, wire_name(torch.bfloat16), tuple(s))
            for n, s in hf_shapes(self.shape).items()
        ]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for i, pair in enumerate(self.tensors.items()):
            if i == self.fail_at:
                raise RuntimeError("trainer crashed mid-round")
            yield pair


@pytest.fixture(scope="module")
def worker() -> Iterator[LoopbackClient]:
    proc, client = spawn_stub("weightwire_tcp", "cpu", "tiny", timeout=60)
    yield client
    try:
        client.exit()
    finally:
        proc.wait(timeout=30)


def trainer(client: LoopbackClient, source: RoundSource, budget: int) -> Any:
    from weightwire.torch_side.sender.engine import TorchTrainerEngine

    info = TrainerInitInfo(
        backend="weightwire_tcp", packed_buffer_size_bytes=16 << 10, stage_budget_bytes=budget
    )
    return TorchTrainerEngine.trainer_init(info, client=client, source=source)


@pytest.mark.parametrize("strategy", list(BUDGETS))
def test_vllm_engine_lands_rounds_and_reports_an_incomplete_one(
    worker: LoopbackClient, strategy: str
) -> None:
    source = RoundSource("tiny", torch.device("cpu"))
    engine = trainer(worker, source, BUDGETS[strategy])
    try:
        want = source.reseed(1)
        engine.send_weights()
        assert worker.call("digests") == want
        # The trainer fails late in the round, once most chunks were broadcast.
        source.reseed(2)
        source.fail_at = len(want) - 1
        with pytest.raises(Exception, match="trainer crashed mid-round"):
            engine.send_weights()
    finally:
        engine.shutdown()
    got = worker.call("digests")  # under the worker's lock: after its update call has ended
    incomplete = worker.call("incomplete")
    if strategy == "staged":
        assert incomplete is None and got == want
    elif incomplete is None:
        # The worker's update began after the trainer had already dropped the link (a loaded
        # host): nothing was applied, and the model is exactly the previous round's.
        assert got == want
    else:
        # Chunks were applied in place: the worker says so, and the model is part new.
        assert "incomplete weight round" in incomplete, incomplete
        assert (
            got != want
            and got["model.layers.0.self_attn.q_proj.weight"]
            != want["model.layers.0.self_attn.q_proj.weight"]
        )
    source.fail_at = None
    engine = trainer(worker, source, BUDGETS[strategy])
    try:
        want = source.reseed(3)
        engine.send_weights()
    finally:
        engine.shutdown()
    assert worker.call("digests") == want and worker.call("incomplete") is None
