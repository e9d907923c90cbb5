"""The loopback control shim (used by the GPU test and benchmarks), exercised on CPU:
a JAX trainer engine drives a WeightwireTCPEngine receiver process through it."""

from __future__ import annotations

import hashlib
import re

import ml_dtypes
import numpy as np
import pytest

from tests.trainer.fakes import DictSource
from weightwire.jax_side.dtypes import describe
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.shared.errors import WeightSyncError
from weightwire.shared.served import ServedModel, ServedModelMismatch
from weightwire.shared.timeouts import Timeouts
from weightwire.testing.loopback import LOOPBACK_VERSION
from weightwire.trainer import TrainerInitInfo


def test_loopback_receiver_gets_exact_bytes(loopback) -> None:
    rng = np.random.default_rng(1)
    weights = {
        "model.embed_tokens.weight": rng.standard_normal((300, 64)).astype(ml_dtypes.bfloat16),
        "model.layers.0.mlp.gate_proj.weight": rng.standard_normal((64, 96)).astype(np.float32),
        "model.layers.0.mlp.scale": np.array(0.5, np.float16),
        "model.norm.weight": rng.standard_normal(64).astype(np.float32),
    }
    assert loopback.version() == LOOPBACK_VERSION and loopback.get_world_size() == 1
    info = TrainerInitInfo(
        backend="weightwire_tcp",
        packed_buffer_size_bytes=16 << 10,
        verify=True,
        timeouts=Timeouts(http_s=60, connect_s=30, warmup_s=30, transfer_s=30),
    )
    engine = JAXTrainerEngine.trainer_init(
        info, client=loopback, source=DictSource(weights, describe)
    )
    try:
        for step in range(2):
            weights["model.norm.weight"] = weights["model.norm.weight"] + np.float32(step + 1)
            engine.send_weights()
            (reply,) = loopback.weight_checker("checksum")
            want = {
                n: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
                for n, a in weights.items()
            }
            assert reply["checksums"] == want
            assert loopback.weight_info() == [{"weight_version": str(step + 1)}]
            stats = loopback.stats()
            assert stats is not None and stats["nbytes"] == sum(a.nbytes for a in weights.values())
            assert stats["tensors"] == len(weights)
    finally:
        engine.shutdown()
    with pytest.raises(
        WeightSyncError, match=r"start_weight_update failed on 127\.0\.0\.1:\d+ \(status 500\)"
    ):
        loopback.start_weight_update()  # the session was shut down: the receiver refuses


def test_loopback_receiver_applies_delta_rounds(loopback) -> None:
    """``delta="auto"``: the loopback receiver's store applies the patches at commit; its
    checksums (verify) are over the full tensors."""
    rng = np.random.default_rng(2)
    weights = {
        "model.embed_tokens.weight": rng.standard_normal((300, 64)).astype(ml_dtypes.bfloat16),
        "model.layers.0.mlp.gate_proj.weight": rng.standard_normal((64, 96)).astype(np.float32),
        "model.norm.weight": rng.standard_normal(64).astype(np.float32),
    }
    info = TrainerInitInfo(
        backend="weightwire_tcp",
        delta="auto",
        verify=True,
        timeouts=Timeouts(http_s=60, connect_s=30, warmup_s=30, transfer_s=30),
    )
    engine = JAXTrainerEngine.trainer_init(
        info, client=loopback, source=DictSource(weights, describe)
    )
    try:
        engine.send_weights()
        for step in range(3):
            embed = weights["model.embed_tokens.weight"].copy()
            embed[step * 7 : step * 7 + 3] += ml_dtypes.bfloat16(1.0)
            weights["model.embed_tokens.weight"] = embed
            metrics = engine.send_weights()
            assert metrics.density is not None and metrics.wire_bytes < metrics.dense_bytes / 20
            (reply,) = loopback.weight_checker("checksum")
            want = {
                n: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
                for n, a in weights.items()
            }
            assert {n: reply["checksums"][n] for n in want} == want
    finally:
        engine.shutdown()


class TellingClient:
    """The loopback client with a server that tells its model at init, as the reference
    server's reply does (``HTTPWeightSyncClient.served_model``)."""

    def __init__(self, inner: object, served: ServedModel) -> None:
        self.inner = inner
        self.served = served

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def served_model(self) -> ServedModel:
        return self.served


@pytest.mark.parametrize("delta", ["off", "auto"])
def test_rounds_that_do_not_fit_the_served_model_raise_before_any_call(loopback, delta) -> None:
    """The JAX engine's public API with wrong inputs: each raises ``ServedModelMismatch`` at the
    call (an overlapped round too, not by its handle; a delta round on its dense metadata),
    and the receiver saw no round; the right round then commits."""
    rng = np.random.default_rng(3)
    weights = {
        "model.embed_tokens.weight": rng.standard_normal((300, 64)).astype(ml_dtypes.bfloat16),
        "model.layers.0.mlp.gate_proj.weight": rng.standard_normal((64, 96)).astype(np.float32),
        "model.norm.weight": rng.standard_normal(64).astype(np.float32),
    }
    served = ServedModel.of(DictSource(weights, describe).metadata())
    norm, gate = "model.norm.weight", "model.layers.0.mlp.gate_proj.weight"
    wrong = {
        "missing": ({n: a for n, a in weights.items() if n != norm}, "TrainerInitInfo(partial"),
        "unknown": ({**weights, "model.norm.bias": weights[norm]}, "[model.norm.bias] unknown"),
        "dtype": (
            {**weights, gate: weights[gate].astype(ml_dtypes.bfloat16)},
            "cast the source to float32",
        ),
        "shape": ({**weights, norm: weights[norm][:32]}, f"{norm} [32] (served: [64])"),
    }
    source = DictSource(dict(weights), describe)
    info = TrainerInitInfo(
        backend="weightwire_tcp",
        delta=delta,
        timeouts=Timeouts(http_s=60, connect_s=30, warmup_s=30, transfer_s=30),
    )
    engine = JAXTrainerEngine.trainer_init(
        info, client=TellingClient(loopback, served), source=source
    )
    try:
        version = loopback.weight_info()
        for case, (tensors, words) in wrong.items():
            source.tensors = tensors
            for wait in (True, False):
                with pytest.raises(ServedModelMismatch, match=re.escape(words)):
                    engine.send_weights(case, wait=wait)
        assert loopback.weight_info() == version  # no round reached the receiver
        source.tensors = weights
        engine.send_weights("fits")
        assert loopback.weight_info() == [{"weight_version": "fits"}]
    finally:
        engine.shutdown()
