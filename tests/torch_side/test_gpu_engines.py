"""Worker engines on GPUs (run on the GPU host: ``pytest -m gpu``).

weightwire_nccl: a sender process on cuda:0 (NCCLCommunicator rank 0), the engine +
HFModelHost on cuda:1 in this process. weightwire_tcp on a CUDA worker: bytes land in
pinned staging buffers and are copied to the device.
"""

from __future__ import annotations

import base64
import secrets
import time

import pytest
import torch
from safetensors.torch import save_file

from weightwire.backends.nccl.info import WeightwireNCCLInitInfo
from weightwire.backends.tcp.info import TCPInitInfo
from weightwire.shared.info import encode_secret
from weightwire.shared.update_info import UpdateInfo
from weightwire.torch_side.sender.source import ModuleSource
from weightwire.torch_side.worker.core import WeightReceiveError
from weightwire.torch_side.worker.engines import WeightwireNCCLEngine, WeightwireTCPEngine
from weightwire.torch_side.worker.hf_host import HFModelHost

from ._procs import SenderProcess
from ._tiny import tiny_llama

pytestmark = [pytest.mark.gpu(count=2), pytest.mark.timeout(300)]


def _start(cfg: dict, tmp_path, *, timeout_s: float = 60.0):
    from weightwire.backends.nccl.library import mint_unique_id  # cupy: GPU hosts only

    dtype = getattr(torch, cfg["dtype"])
    trainer_named = list(ModuleSource(tiny_llama(seed=1, dtype=dtype)))
    save_file(dict(trainer_named), str(tmp_path / "trainer.safetensors"))
    uid = mint_unique_id()
    sender = SenderProcess(
        {
            **cfg,
            "backend": "weightwire_nccl",
            "weights": str(tmp_path / "trainer.safetensors"),
            "names": [n for n, _ in trainer_named],
            "unique_id_b64": base64.b64encode(uid).decode(),
            "world_size": 2,
        }
    )
    try:
        model = tiny_llama(seed=99, dtype=dtype).to("cuda:1")
        host = HFModelHost(model)
        engine = WeightwireNCCLEngine.standalone(model=host, device="cuda:1")
        info = WeightwireNCCLInitInfo(
            nccl_unique_id_b64=base64.b64encode(uid).decode(),
            rank_offset=1,
            world_size=2,
            packed=cfg["packed"],
            packed_buffer_size_bytes=cfg["buffer_size"],
            packed_num_buffers=2,
            timeout_s=timeout_s,
        )
        engine.init_transfer_engine(info.to_dict())
    except BaseException:
        sender.kill()
        raise
    return sender, host, engine, UpdateInfo.from_metas(ModuleSource(model).metadata()).to_dict()


@pytest.mark.parametrize(
    ("packed", "dtype", "buffer_size"),
    [(True, "bfloat16", 4096), (False, "float32", 4096)],
    ids=["packed-bf16", "unpacked-f32"],
)
def test_nccl_three_rounds_bit_exact(packed, dtype, buffer_size, tmp_path):
    cfg = {"dtype": dtype, "packed": packed, "buffer_size": buffer_size, "rounds": 3}
    sender, host, engine, update = _start(cfg, tmp_path)
    try:
        for r in range(3):
            engine.start_weight_update()
            engine.update_weights(
                update if r == 0 else {"names": [], "dtype_names": [], "shapes": []}
            )
            engine.finish_weight_update()
            sent = sender.read()
            assert host.state_checksums() == sent["checksums"], f"round {r} differs"
        assert sender.read() == {"done": True}
    finally:
        engine.shutdown()
        sender.kill()


def test_nccl_silent_sender_times_out_and_keeps_weights(tmp_path):
    cfg = {"dtype": "float32", "packed": True, "buffer_size": 4096, "rounds": 1, "stall_s": 60}
    sender, host, engine, update = _start(cfg, tmp_path, timeout_s=3.0)
    try:
        before = host.state_checksums()
        engine.start_weight_update()
        t0 = time.monotonic()
        with pytest.raises(WeightReceiveError, match="TransferTimeout"):
            engine.update_weights(update)
        assert time.monotonic() - t0 < 30
        assert host.state_checksums() == before and not host.in_round
    finally:
        engine.shutdown()
        sender.kill()


@pytest.mark.gpu(count=1)
def test_tcp_engine_on_a_cuda_worker(tmp_path):
    trainer_named = list(ModuleSource(tiny_llama(seed=1, dtype=torch.bfloat16)))
    save_file(dict(trainer_named), str(tmp_path / "trainer.safetensors"))
    secret = secrets.token_bytes(128)
    sender = SenderProcess(
        {
            "dtype": "bfloat16",
            "packed": True,
            "buffer_size": 4096,
            "rounds": 2,
            "world_size": 2,
            "weights": str(tmp_path / "trainer.safetensors"),
            "names": [n for n, _ in trainer_named],
            "secret_b64": encode_secret(secret),
        }
    )
    engine = None
    try:
        port = sender.read()["port"]
        host = HFModelHost(tiny_llama(seed=99, dtype=torch.bfloat16).to("cuda:0"))
        engine = WeightwireTCPEngine.standalone(model=host, device="cuda:0")
        engine.init_transfer_engine(
            TCPInitInfo(
                host="127.0.0.1",
                port=port,
                secret_b64=encode_secret(secret),
                rank_offset=1,
                world_size=2,
                packed=True,
                packed_buffer_size_bytes=4096,
                packed_num_buffers=3,
                timeout_s=60.0,
            )
        )
        update = UpdateInfo.from_metas(ModuleSource(host.model).metadata()).to_dict()
        for r in range(2):
            engine.start_weight_update()
            engine.update_weights(update)
            engine.finish_weight_update()
            assert host.state_checksums() == sender.read()["checksums"], f"round {r} differs"
    finally:
        if engine is not None:
            engine.shutdown()
        sender.kill()
