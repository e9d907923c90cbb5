"""vLLM's ``VllmWeightwireIPCEngine`` on ONE GPU receiving a Llama-3-8B-shaped bf16 round
(~16 GB) over ``weightwire_ipc`` from a ``TorchTrainerEngine`` in this process.

vLLM is not installed on the GPU machine: the worker process
(``tests.torch_side.vllm_stub``) stubs the few ``vllm.*`` pieces the engine imports with
fakes that buffer and apply layers the way vLLM's layerwise reload does, into parameters
laid out like vLLM's Llama (fused ``qkv_proj`` / ``gate_up_proj``). Per strategy:

- ``streaming`` (the default budget, 1 GiB, is far below the round): the worker's extra
  memory over the round, torch's peak over its baseline plus the IPC receive pool (raw
  ``cudaMalloc``, outside torch's counters), is at most the receive pool plus the budget,
  and the pool is far below the round's size;
- ``staged`` (a budget above the round): the same round held whole, for comparison;

and every parameter holds the trainer's bytes (per Hugging Face tensor digests read
back out of the fused parameters). Prints the numbers.

    CUDA_VISIBLE_DEVICES=0 pytest -m gpu -s tests/gpu/test_vllm_stub_ipc_gpu.py
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.torch_side._procs import spawn_stub

GIB = 1 << 30
BUDGETS = {"streaming": 1 * GIB, "staged": 64 * GIB}


@pytest.fixture(scope="module")
def worker() -> Iterator[object]:
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    proc, client = spawn_stub(
        "weightwire_ipc", "cuda:0", "llama3-8b", env={"CUDA_VISIBLE_DEVICES": gpu}, timeout=300
    )
    yield client
    try:
        client.exit()
    finally:
        proc.wait(timeout=120)


@pytest.mark.gpu
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("strategy", list(BUDGETS))
def test_8b_round_into_vllm_layout_memory_and_bytes(worker: object, strategy: str) -> None:
    import torch

    from tests.torch_side.test_vllm_engine_stub import RoundSource
    from weightwire.shared.staging import round_bytes
    from weightwire.torch_side.sender.engine import TorchTrainerEngine
    from weightwire.trainer import TrainerInitInfo

    budget = BUDGETS[strategy]
    source = RoundSource("llama3-8b", torch.device("cuda", 0))
    nbytes = round_bytes(source.metadata())
    info = TrainerInitInfo(
        backend="weightwire_ipc",
        packed_buffer_size_bytes=GIB,
        packed_num_buffers=2,
        stage_budget_bytes=budget,
        device=0,
        ipc_mode="pull",  # the staged and streaming strategies of the pull path (not auto's)
    )
    engine = TorchTrainerEngine.trainer_init(info, client=worker, source=source)
    try:
        for seed in (1, 2):  # round 2: the pool exists already; what a training run sees every step
            want = source.reseed(seed)
            metrics = engine.send_weights()
            mem = worker.call("memory")  # type: ignore[attr-defined]
            torch_extra = mem["peak"] - mem["baseline"]
            extra = torch_extra + mem["pool"]
            print(
                f"\n[{strategy} round {seed}] round {nbytes / 1e9:.2f} GB in "
                f"{metrics.seconds['transfer']:.2f} s; worker extra {extra / 1e9:.2f} GB = torch "
                f"peak delta {torch_extra / 1e9:.2f} GB + receive pool {mem['pool'] / 1e9:.2f} "
                f"GB (budget {budget / 1e9:.2f} GB)"
            )
            assert worker.call("digests") == want  # type: ignore[attr-defined]
            assert worker.call("incomplete") is None  # type: ignore[attr-defined]
            if strategy == "streaming":
                assert extra <= mem["pool"] + budget, (extra, mem)
                assert mem["pool"] < nbytes / 2, mem  # the pool does not grow with the model
            else:
                assert extra >= nbytes, (extra, mem)  # the whole round held: what the budget avoids
    finally:
        engine.shutdown()
