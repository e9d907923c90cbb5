"""Acceptance: a trainer process -> weightwire_tcp engine + HFModelHost over TCP on CPU.

The sender is a separate process (``_sender.py``: TCPRendezvous + shared framing);
the receiver is the real engine loading a tiny Llama. Three rounds of changed weights
must land bit-exactly (sha256 of every parameter equal on both sides).
"""

from __future__ import annotations

import secrets

import pytest
import torch
from safetensors.torch import save_file

from weightwire.backends.tcp.info import TCPInitInfo
from weightwire.shared.framing import plan
from weightwire.shared.info import encode_secret
from weightwire.shared.staging import round_bytes
from weightwire.shared.update_info import UpdateInfo
from weightwire.torch_side.sender.source import ModuleSource
from weightwire.torch_side.worker.core import WeightReceiveError
from weightwire.torch_side.worker.engines import WeightwireTCPEngine
from weightwire.torch_side.worker.hf_host import HFModelHost

from ._procs import SenderProcess
from ._tiny import tiny_llama

pytestmark = pytest.mark.timeout(180)


def _start(cfg: dict, tmp_path, *, load_batching: str = "chunk"):
    dtype = getattr(torch, cfg["dtype"])
    # The trainer's initial weights (another seed than the receiver's), as the sender reads them.
    trainer_named = list(ModuleSource(tiny_llama(seed=1, dtype=dtype, tied=cfg["tied"])))
    save_file(dict(trainer_named), str(tmp_path / "trainer.safetensors"))
    secret = secrets.token_bytes(128)
    sender = SenderProcess(
        {
            **cfg,
            "weights": str(tmp_path / "trainer.safetensors"),
            "names": [n for n, _ in trainer_named],
            "secret_b64": encode_secret(secret),
            "world_size": 2,
        }
    )
    try:
        port = sender.read()["port"]
        model = tiny_llama(seed=99, dtype=dtype, tied=cfg["tied"])
        host = HFModelHost(model)
        engine = WeightwireTCPEngine.standalone(
            model=host, device="cpu", load_batching=load_batching
        )
        info = TCPInitInfo(
            host="127.0.0.1",
            port=port,
            secret_b64=encode_secret(secret),
            rank_offset=1,
            world_size=2,
            packed=cfg["packed"],
            packed_buffer_size_bytes=cfg["buffer_size"],
            packed_num_buffers=2,
            timeout_s=30.0,
        )
        engine.init_transfer_engine(engine.parse_init_info(info.to_dict()))
    except BaseException:
        sender.kill()
        raise
    update = UpdateInfo.from_metas(ModuleSource(model).metadata()).to_dict()
    return sender, host, engine, update


@pytest.mark.parametrize(
    ("packed", "dtype", "tied", "buffer_size", "reuse", "batching"),
    [
        (True, "float32", False, 4096, True, "chunk"),  # many chunks, 0.33 reuse shorthand
        (True, "bfloat16", True, 1 << 20, False, "group"),  # one chunk, tied lm_head omitted
        (False, "bfloat16", False, 4096, False, "chunk"),  # unpacked: one broadcast per tensor
    ],
    ids=["packed-f32-reuse", "packed-bf16-tied-group", "unpacked-bf16"],
)
def test_three_rounds_bit_exact(packed, dtype, tied, buffer_size, reuse, batching, tmp_path):
    cfg = {"dtype": dtype, "tied": tied, "packed": packed, "buffer_size": buffer_size, "rounds": 3}
    sender, host, engine, update = _start(cfg, tmp_path, load_batching=batching)
    dense = round_bytes(ModuleSource(host.model).metadata())
    try:
        assert engine.round_stats() is None  # no round yet
        previous = host.state_checksums()
        for r in range(3):
            body = {"names": [], "dtype_names": [], "shapes": []} if reuse and r > 0 else update
            engine.start_weight_update()
            engine.update_weights(body)
            engine.finish_weight_update()
            sent = sender.read()
            assert sent["round"] == r
            got = host.state_checksums()
            assert got == sent["checksums"], f"round {r}: received bytes differ from the trainer's"
            assert all(got[n] != previous[n] for n in got), (
                f"round {r}: some weights did not change"
            )
            assert engine.last_stats is not None and engine.last_stats.chunks == sent["chunks"]
            # The worker's own count of the round: every byte of every tensor, once.
            assert engine.round_stats() == {
                "rank": 0,
                "session": engine._core.session,
                "bytes_received": dense,
                "updates": 1,
                "committed": True,
            }
            previous = got
        assert host.rounds_committed == 3
        assert sender.read() == {"done": True}
        assert sender.wait() == 0
        if tied:
            assert host.model.lm_head.weight is host.model.model.embed_tokens.weight
    finally:
        engine.shutdown()
        sender.kill()


def test_sender_dies_mid_stream_leaves_weights_unchanged(tmp_path):
    cfg = {
        "dtype": "float32",
        "tied": False,
        "packed": True,
        "buffer_size": 2048,
        "rounds": 2,
        "die_in_round": 1,
        "die_after_chunks": 3,
    }
    sender, host, engine, update = _start(cfg, tmp_path)
    aborts: list[int] = []
    real_abort = host.abort_round

    def counting_abort() -> None:
        aborts.append(1)
        real_abort()

    host.abort_round = counting_abort  # type: ignore[method-assign]
    try:
        engine.start_weight_update()
        engine.update_weights(update)
        engine.finish_weight_update()
        good = sender.read()
        assert host.state_checksums() == good["checksums"]

        engine.start_weight_update()
        with pytest.raises(
            WeightReceiveError, match=r"round failed at chunk 4/\d+ \(PeerLost"
        ) as err:
            engine.update_weights(update)
        assert "call init_weight_transfer_engine again" in str(err.value)
        assert sender.wait() == 3
        # The worker counted the three chunks that landed; the round is neither whole nor
        # committed.
        metas = ModuleSource(host.model).metadata()
        landed = sum(c.nbytes for c in plan(metas, packed=True, buffer_size_bytes=2048)[:3])
        stats = engine.round_stats()
        assert stats is not None and (stats["bytes_received"], stats["updates"]) == (landed, 0)
        assert not stats["committed"] and 0 < landed < round_bytes(metas)
        assert (
            aborts == []
        )  # staged (within the default budget): the model's own round was never opened
        assert host.state_checksums() == good["checksums"], (
            "a failed round must not change any weight"
        )
        assert not host.in_round
        with pytest.raises(RuntimeError, match="without start_weight_update"):
            engine.finish_weight_update()
        with pytest.raises(RuntimeError, match="aborted after a failed round"):
            engine.start_weight_update()
    finally:
        engine.shutdown()
        sender.kill()
