"""GPU: a CUDA worker process of the reference server receives a round over NCCL.

Drives the worker through ``ReplicaPool`` (the API layer needs fastapi/uvicorn, which
the GPU host lacks): same JSON-lines protocol, same worker code, real NCCL from a
test-local sender on GPU 0 into the worker on GPU 1. Run with ``pytest -m gpu``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
from pathlib import Path

import numpy as np
import pytest

from weightwire.shared.framing import pack_host, plan
from weightwire.shared.meta import ParamMeta


@pytest.mark.gpu(count=2)
def test_nccl_round_into_a_cuda_worker(tiny_llama: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cp = pytest.importorskip("cupy")
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    from weightwire.backends.nccl.comm import NCCLCommunicator
    from weightwire.backends.nccl.library import mint_unique_id
    from weightwire.tools.server.completions import parse_completion_request
    from weightwire.tools.server.replica import WorkerSpec
    from weightwire.tools.server.replicas import ReplicaPool

    cp.cuda.Device(0).use()
    cp.zeros(1)  # the test process owns GPU 0 before the worker env narrows to GPU 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # inherited by the worker only

    base = load_file(str(Path(tiny_llama) / "model.safetensors"))
    rng = np.random.default_rng(7)
    new = {k: v + rng.standard_normal(v.shape).astype(np.float32) * 0.05 for k, v in base.items()}
    metas = [ParamMeta(k, "float32", v.shape) for k, v in new.items()]
    arrays = list(new.values())
    chunks = plan(metas, packed=True, buffer_size_bytes=1 << 16)
    uid = mint_unique_id()
    init_info = {
        "nccl_unique_id_b64": base64.b64encode(uid).decode(),
        "rank_offset": 1,
        "world_size": 2,
        "packed": True,
        "packed_buffer_size_bytes": 1 << 16,
        "packed_num_buffers": 2,
        "timeout_s": 60.0,
    }
    update_info = {
        "names": [m.name for m in metas],
        "dtype_names": ["float32"] * len(metas),
        "shapes": [list(m.shape) for m in metas],
    }
    request = parse_completion_request(
        {
            "prompt": [5, 6, 7],
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
        vocab_size=512,
        max_model_len=256,
    )

    async def scenario() -> tuple[list, dict]:
        pool = await ReplicaPool.start(
            WorkerSpec(
                model_dir=tiny_llama,
                backend="weightwire_nccl",
                device="cuda",
                replicas=1,
                threads=2,
            ),
            startup_timeout=300,
        )
        try:
            assert pool.replicas[0].info["device"] == "cuda:0"
            init = asyncio.ensure_future(
                pool.fan_out("init", {"init_info": init_info}, timeout=120)
            )
            comm = await asyncio.to_thread(
                NCCLCommunicator.join, unique_id=uid, rank=0, world_size=2, device=0, timeout=60
            )
            await asyncio.to_thread(comm.warmup, timeout=60)
            assert (await init) == [{"rank": 1}]
            await pool.fan_out("start", timeout=60)
            update = asyncio.ensure_future(
                pool.fan_out("update", {"update_info": update_info}, timeout=120)
            )
            for chunk in chunks:
                buf = cp.asarray(pack_host(arrays[chunk.start : chunk.stop], chunk))
                await asyncio.to_thread(comm.broadcast, buf, timeout=60)
            stats = (await update)[0]
            assert stats["tensors"] == len(metas) and stats["chunks"] == len(chunks)
            await pool.fan_out("finish", timeout=60)
            sums = await pool.fan_out("checksum", timeout=60)
            out = await pool.replicas[0].call(
                "generate", {"request": request.to_worker()}, timeout=60
            )
            await pool.fan_out("shutdown", timeout=60)
            comm.close()
            return sums, out
        finally:
            await pool.close()

    sums, out = asyncio.run(asyncio.wait_for(scenario(), 600))
    assert sums[0] == {k: hashlib.sha256(v.tobytes()).hexdigest() for k, v in new.items()}
    choice = out["choices"][0]
    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in new.items()})
    ids = torch.tensor([choice["prompt_token_ids"] + choice["token_ids"][:-1]])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0], dim=-1)
    want = logp[torch.arange(2, ids.shape[1]), torch.tensor(choice["token_ids"])].tolist()
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], want, atol=1e-3)
