"""Delta rounds through the engine (JAX and torch) against a fake server and an in-test
worker that applies what arrives with numpy: the first round is dense, later ones carry
only changed tensors and patches on the committed base, a refused base is resent dense in
the same call, and a failed round drops the base."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from tests.trainer.delta_receiver import DeltaReceiver
from tests.trainer.fakes import FAKE, FAST, DictSource, FakeComm, FakeServer
from weightwire.shared.dtypes import wire_dtype
from weightwire.shared.errors import ConfigError
from weightwire.trainer import TrainerInitInfo


@pytest.fixture(autouse=True)
def fresh_comm() -> None:
    FAKE.comm = FakeComm()
    FAKE.opened.clear()


def host_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    bf16 = ml_dtypes.bfloat16
    return {
        "model.embed_tokens.weight": rng.standard_normal((64, 16)).astype(bf16),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((16, 16)).astype(bf16),
        "model.layers.0.self_attn.q_proj.bias": rng.standard_normal(16).astype(bf16),
        "model.layers.0.mlp.experts.w1": rng.standard_normal((4, 8, 16)).astype(bf16),
        "model.layers.0.input_layernorm.weight": rng.standard_normal(16).astype(np.float32),
        "model.norm.weight": rng.standard_normal(16).astype(np.float32),
        "lm_head.weight": rng.standard_normal((64, 16)).astype(bf16),
    }


class Kind:
    """One framework: its engine, how it holds a host array, and how it reads one back."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "jax":
            import jax.numpy as jnp

            from weightwire.jax_side.dtypes import describe
            from weightwire.jax_side.engine import JAXTrainerEngine

            self.engine, self.describe = JAXTrainerEngine, describe
            self.wrap: Callable[[np.ndarray], Any] = jnp.asarray
            self.host: Callable[[Any], np.ndarray] = np.asarray
        else:
            import torch

            from weightwire.torch_side.sender.engine import TorchTrainerEngine

            def describe(t: Any) -> tuple[str, tuple[int, ...]]:
                return TorchTrainerEngine.describe(None, t)  # type: ignore[arg-type]

            def wrap(a: np.ndarray) -> Any:
                if a.dtype == ml_dtypes.bfloat16:
                    return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
                return torch.from_numpy(a.copy())

            def host(t: Any) -> np.ndarray:
                if t.dtype == torch.bfloat16:
                    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
                return t.numpy()

            self.engine, self.describe, self.wrap, self.host = (
                TorchTrainerEngine,
                describe,
                wrap,
                host,
            )


@pytest.fixture(params=["jax", "torch"])
def kind(request: pytest.FixtureRequest) -> Kind:
    return Kind(request.param)


def start(kind: Kind, **info: Any) -> tuple[Any, DictSource, DeltaReceiver, FakeServer]:
    server = FakeServer()
    weights = host_weights()
    source = DictSource({n: kind.wrap(a) for n, a in weights.items()}, kind.describe)
    receiver = DeltaReceiver(server, {n: np.zeros_like(a) for n, a in weights.items()})
    init = TrainerInitInfo(backend="fake_host", timeouts=FAST, delta="auto", **info)
    engine = kind.engine.trainer_init(init, client=server.client(), source=source)
    return engine, source, receiver, server


def step(kind: Kind, source: DictSource, rng: np.random.Generator, fractions: dict) -> None:
    """Change ``fractions[name]`` of each named tensor's elements (an RL-like step)."""
    for name, fraction in fractions.items():
        array = kind.host(source.tensors[name]).copy()
        flat = array.reshape(-1)
        picked = rng.random(flat.size) < fraction
        flat[picked] = (flat[picked].astype(np.float32) + 0.5).astype(flat.dtype)
        source.tensors[name] = kind.wrap(array)


def changed_elements(old: np.ndarray, new: np.ndarray) -> int:
    word = np.dtype(f"u{old.itemsize}")
    return int(np.count_nonzero(old.reshape(-1).view(word) != new.reshape(-1).view(word)))


def held(kind: Kind, source: DictSource) -> dict[str, bytes]:
    return {n: kind.host(t).tobytes() for n, t in source.tensors.items()}


def assert_receiver_holds(kind: Kind, receiver: DeltaReceiver, source: DictSource) -> None:
    assert {n: a.tobytes() for n, a in receiver.weights.items()} == held(kind, source)


def test_first_round_dense_then_patches_on_the_committed_base(kind: Kind) -> None:
    engine, source, receiver, server = start(kind)
    rng = np.random.default_rng(1)
    first = engine.send_weights()
    one = receiver.infos[-1]
    assert one.round_token and one.delta_base is None and not one.patches
    assert len(one.names) == 7 and first.density is None
    assert_receiver_holds(kind, receiver, source)
    (init,) = server.bodies("init_weight_transfer_engine")
    assert init["init_info"]["delta_rounds"] is True

    before = {n: kind.host(t).copy() for n, t in source.tensors.items()}
    step(
        kind,
        source,
        rng,
        {
            "model.layers.0.self_attn.q_proj.weight": 0.02,
            "model.layers.0.mlp.experts.w1": 0.05,
            "model.norm.weight": 0.9,  # most of it: sent dense
            "lm_head.weight": 0.01,
        },
    )
    second = engine.send_weights()
    two = receiver.infos[-1]
    assert two.delta_base == one.round_token and two.round_token != one.round_token
    assert sorted(p[0] for p in two.patches or []) == [
        "lm_head.weight",
        "model.layers.0.mlp.experts.w1",
        "model.layers.0.self_attn.q_proj.weight",
    ]
    dense = [n for n in two.names if "@" not in n]
    assert dense == ["model.norm.weight"]  # unchanged tensors are left out
    assert_receiver_holds(kind, receiver, source)
    assert second.wire_bytes < second.dense_bytes == first.dense_bytes
    changed = sum(changed_elements(old, kind.host(source.tensors[n])) for n, old in before.items())
    assert second.density == changed / sum(a.size for a in before.values())
    assert second.extract_seconds > 0 and "extract" in second.seconds

    third = engine.send_weights()  # nothing changed: still a delta round on its base
    three = receiver.infos[-1]
    assert three.delta_base == two.round_token and len(three.patches or []) == 1
    assert third.density == 0.0
    assert_receiver_holds(kind, receiver, source)

    engine.send_weights(dense=True)
    four = receiver.infos[-1]
    assert four.delta_base is None and len(four.names) in (0, 7)
    assert_receiver_holds(kind, receiver, source)
    engine.shutdown()


def test_a_refused_base_is_resent_dense_in_the_same_call(kind: Kind) -> None:
    engine, source, receiver, _ = start(kind)
    engine.send_weights()
    step(kind, source, np.random.default_rng(2), {"lm_head.weight": 0.03})
    receiver.restart()  # e.g. the server restarted from its checkpoint
    metrics = engine.send_weights("v2")
    assert receiver.refused == 1
    assert [i.delta_base is not None for i in receiver.infos] == [False, True, False]
    assert metrics.version == "v2" and metrics.density is None
    assert_receiver_holds(kind, receiver, source)
    assert len(FAKE.opened) == 2  # the refusal aborted the wire: reopened once
    step(kind, source, np.random.default_rng(3), {"lm_head.weight": 0.03})
    engine.send_weights()  # and delta rounds resume on the new base
    assert receiver.infos[-1].delta_base == receiver.infos[-2].round_token
    assert_receiver_holds(kind, receiver, source)
    engine.shutdown()


def test_a_failed_round_drops_the_base_and_anchors_are_dense(kind: Kind) -> None:
    engine, source, receiver, server = start(kind, delta_anchor_every=3)
    engine.send_weights()
    step(kind, source, np.random.default_rng(4), {"lm_head.weight": 0.03})
    server.fail["finish_weight_update"] = (500, "boom")
    with pytest.raises(Exception, match="boom"):
        engine.send_weights()
    del server.fail["finish_weight_update"]
    receiver._info = None  # the failed round never committed
    engine.send_weights()
    assert receiver.infos[-1].delta_base is None  # dense after the failure
    assert_receiver_holds(kind, receiver, source)
    bases = []
    for i in range(4):
        step(kind, source, np.random.default_rng(5 + i), {"lm_head.weight": 0.03})
        engine.send_weights()
        bases.append(receiver.infos[-1].delta_base is not None)
        assert_receiver_holds(kind, receiver, source)
    assert bases == [True, True, False, True]  # every third round is dense
    engine.shutdown()


def test_verify_checks_patched_tensors_whole(kind: Kind) -> None:
    engine, source, receiver, _ = start(kind, verify=True)
    engine.send_weights()
    step(kind, source, np.random.default_rng(9), {"lm_head.weight": 0.03})
    metrics = engine.send_weights()
    assert receiver.infos[-1].patches and metrics.verify is not None
    assert metrics.verify.checked == 1  # lm_head, checked whole (not its @index / @values)
    engine.shutdown()


def test_delta_settings_are_checked() -> None:
    # The backends named instead are the registry's that take patches.
    takers = "weightwire_tcp, weightwire_nccl, sparse_nccl, weightwire_ipc"
    with pytest.raises(ConfigError, match=f"delta='auto' needs a .*take patches \\({takers}\\)"):
        TrainerInitInfo(backend="nccl", delta="auto")
    with pytest.raises(ConfigError, match="delta must be 'off' or 'auto'"):
        TrainerInitInfo(backend="weightwire_tcp", delta="on")
    with pytest.raises(ConfigError, match=r"delta_density must be in \(0, 1\]"):
        TrainerInitInfo(backend="weightwire_tcp", delta="auto", delta_density=0)
    with pytest.raises(ConfigError, match="delta_anchor_every must be an int >= 0"):
        TrainerInitInfo(backend="weightwire_tcp", delta="auto", delta_anchor_every=-1)
    with pytest.raises(
        ConfigError, match="ipc_mode='write_through': delta rounds over weightwire_ipc"
    ):
        TrainerInitInfo(backend="weightwire_ipc", delta="auto", ipc_mode="write_through")
    TrainerInitInfo(backend="weightwire_ipc", delta="auto", ipc_mode="pull")
    TrainerInitInfo(backend="weightwire_ipc", delta="auto")  # auto, the default: it pulls
    TrainerInitInfo(backend="weightwire_tcp", delta="auto", ipc_mode="auto")  # not IPC: no matter


def adam_like_step(params: Any, key: Any, lr: float = 1e-5) -> Any:
    """``bf16(w - lr * sign(noise))`` on every leaf (Adam's first step has unit magnitude)."""
    import jax
    import jax.numpy as jnp

    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    return jax.tree.unflatten(
        tree,
        [
            (x.astype(jnp.float32) - lr * jnp.sign(jax.random.normal(k, x.shape))).astype(x.dtype)
            for x, k in zip(leaves, keys, strict=True)
        ],
    )


@pytest.mark.slow  # compiles the kernels for every distinct tensor shape of the model
def test_jax_pytree_source_scanned_moe_tied() -> None:
    """A real ``PytreeSource``: a scanned Qwen2-MoE stack (biases, experts, a tied head), one
    small Adam-like step per round; the worker ends up with exactly what the source yields."""
    import jax

    from weightwire.jax_side import PytreeSource
    from weightwire.jax_side.engine import JAXTrainerEngine
    from weightwire.tools.models import decoder

    cfg = decoder.DecoderConfig.for_family(
        "qwen2_moe",
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        scan_layers=True,
        tie_word_embeddings=True,
    )
    state = {"params": decoder.init(jax.random.key(0), cfg)}
    source = PytreeSource(lambda: state["params"], decoder.naming(cfg), dtype="bfloat16")
    server = FakeServer()
    receiver = DeltaReceiver(
        server, {m.name: np.zeros(m.shape, wire_dtype(m.dtype).numpy) for m in source.metadata()}
    )
    init = TrainerInitInfo(backend="fake_host", timeouts=FAST, delta="auto")
    engine = JAXTrainerEngine.trainer_init(init, client=server.client(), source=source)

    def yielded() -> dict[str, bytes]:
        return {n: np.asarray(a).tobytes() for n, a in source}

    try:
        for i in range(2):
            if i:
                state["params"] = adam_like_step(state["params"], jax.random.key(i))
            metrics = engine.send_weights()
            info = receiver.infos[-1]
            assert (info.delta_base is not None) == (i > 0)
            if i:
                assert info.patches and 0 < (metrics.density or 0) < 1
            assert {n: a.tobytes() for n, a in receiver.weights.items()} == yielded()
    finally:
        engine.shutdown()
