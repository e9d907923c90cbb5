"""``Fp8Source``: a round's named ``X.weight``s sent as FP8 checkpoint pairs, from either
trainer. Its metadata and refusals, and whole rounds over the TCP wire into the loopback
receiver: what arrives is the numpy reference's e4m3 bytes and scales (vLLM's, per
``tests/interop/test_vllm_fp8.py``), dense and delta rounds."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from tests.trainer.fakes import DictSource
from weightwire.jax_side.dtypes import describe
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.jax_side.quant import fp8_source as jax_fp8_source
from weightwire.shared.errors import ConfigError
from weightwire.shared.meta import ParamMeta
from weightwire.shared.quant import (
    Fp8Block,
    Fp8PerTensor,
    Fp8Scheme,
    QuantizationError,
    dequantize_reference,
    quantize_block_reference,
    quantize_tensor_reference,
)
from weightwire.shared.served import ServedModelMismatch
from weightwire.shared.timeouts import Timeouts
from weightwire.torch_side.sender.engine import TorchTrainerEngine
from weightwire.torch_side.sender.quant import fp8_source as torch_fp8_source
from weightwire.torch_side.sender.source import describe_tensor
from weightwire.trainer import TrainerInitInfo

L0 = "model.layers.0"
SPEC: dict[str, Fp8Scheme] = {
    f"{L0}.mlp.down_proj.weight": Fp8Block(),
    f"{L0}.self_attn.o_proj.weight": Fp8Block(ue8m0=True),
    f"{L0}.mlp.gate_proj.weight": Fp8PerTensor(),
}


def _weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def bf16(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(ml_dtypes.bfloat16)

    return {
        "model.embed_tokens.weight": bf16(64, 32),
        f"{L0}.mlp.down_proj.weight": bf16(130, 300),
        f"{L0}.mlp.gate_proj.weight": bf16(96, 130),
        f"{L0}.self_attn.o_proj.weight": bf16(129, 129),
        "model.norm.weight": bf16(32),
    }


def _expected(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, x in weights.items():
        scheme = SPEC.get(name)
        if scheme is None:
            out[name] = x
        elif isinstance(scheme, Fp8PerTensor):
            out[name], out[name + "_scale"] = quantize_tensor_reference(name, x)
        else:
            out[name], out[name + "_scale_inv"] = quantize_block_reference(name, x, scheme)
    return out


def _torch(x: np.ndarray) -> torch.Tensor:
    if x.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(x.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(x.copy())


def _host(t: Any) -> bytes:
    if isinstance(t, torch.Tensor):
        return t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
    return np.ascontiguousarray(np.asarray(t)).tobytes()


def test_the_metadata_holds_each_pair_where_its_weight_was() -> None:
    weights = _weights()
    source = jax_fp8_source(DictSource(weights, describe), SPEC)
    metas = source.metadata()
    assert [(m.name, m.dtype, m.shape) for m in metas] == [
        ("model.embed_tokens.weight", "bfloat16", (64, 32)),
        (f"{L0}.mlp.down_proj.weight", "float8_e4m3fn", (130, 300)),
        (f"{L0}.mlp.down_proj.weight_scale_inv", "float32", (2, 3)),
        (f"{L0}.mlp.gate_proj.weight", "float8_e4m3fn", (96, 130)),
        (f"{L0}.mlp.gate_proj.weight_scale", "float32", ()),
        (f"{L0}.self_attn.o_proj.weight", "float8_e4m3fn", (129, 129)),
        (f"{L0}.self_attn.o_proj.weight_scale_inv", "float32", (2, 2)),
        ("model.norm.weight", "bfloat16", (32,)),
    ]
    # bf16 -> e4m3 halves each weight; the scales cost 4 bytes each
    halves = sum(weights[n].size for n in SPEC)
    assert source.bytes_saved() == halves - 4 * (6 + 1 + 4)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"model.layers.9.mlp.up_proj.weight": Fp8Block()}, "names 'model.layers.9.mlp.up_proj"),
        ({"model.norm.weight": Fp8Block()}, r"'model.norm.weight' has shape \[32\]"),
        ({"model.embed_tokens.bias": Fp8Block()}, "only a linear's 'X.weight'"),
    ],
)
def test_a_spec_the_source_cannot_meet_is_refused_by_name(
    spec: dict[str, Fp8Scheme], match: str
) -> None:
    with pytest.raises(QuantizationError, match=match):
        jax_fp8_source(DictSource(_weights(), describe), spec)


def test_a_scale_the_source_already_sends_is_refused() -> None:
    weights = _weights()
    weights[f"{L0}.mlp.down_proj.weight_scale_inv"] = np.ones((2, 3), np.float32)
    with pytest.raises(QuantizationError, match="already sends .*down_proj.weight_scale_inv"):
        torch_fp8_source(
            DictSource({n: _torch(a) for n, a in weights.items()}, describe_tensor), SPEC
        )


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_a_pass_yields_the_reference_bytes_and_the_error_stats(framework: str) -> None:
    weights = _weights()
    if framework == "jax":
        source = jax_fp8_source(
            DictSource({n: jnp.asarray(a) for n, a in weights.items()}, describe), SPEC, stats=True
        )
    else:
        source = torch_fp8_source(
            DictSource({n: _torch(a) for n, a in weights.items()}, describe_tensor),
            SPEC,
            stats=True,
        )
    want = _expected(weights)
    got = list(source)
    assert [n for n, _ in got] == [m.name for m in source.metadata()] == list(want)
    for name, tensor in got:
        assert _host(tensor) == want[name].tobytes(), name
    assert set(source.last_stats) == set(SPEC)
    assert all(0 < s.mean_abs_error < s.max_abs_error < 0.01 for s in source.last_stats.values())


def test_held_names_follow_the_weights() -> None:
    class Held(DictSource):
        def held_names(self) -> set[str] | None:
            return {f"{L0}.mlp.down_proj.weight", "model.norm.weight"}

    source = jax_fp8_source(Held(_weights(), describe), SPEC)
    assert source.held_names() == {
        f"{L0}.mlp.down_proj.weight",
        f"{L0}.mlp.down_proj.weight_scale_inv",
        "model.norm.weight",
    }
    assert isinstance(source.metadata()[0], ParamMeta)


def _checksums(tensors: dict[str, np.ndarray]) -> dict[str, str]:
    return {n: hashlib.sha256(a.tobytes()).hexdigest() for n, a in tensors.items()}


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_rounds_deliver_the_fp8_pairs_dense_then_delta(loopback: Any, framework: str) -> None:
    info = TrainerInitInfo(
        backend="weightwire_tcp",
        delta="auto",
        verify=True,
        timeouts=Timeouts(http_s=60, connect_s=30, warmup_s=30, transfer_s=30),
    )
    weights = _weights(1)
    engine: Any
    if framework == "jax":
        inner: DictSource = DictSource(dict(weights), describe)
        engine = JAXTrainerEngine.trainer_init(
            info, client=loopback, source=jax_fp8_source(inner, SPEC, stats=True)
        )
    else:
        inner = DictSource({n: _torch(a) for n, a in weights.items()}, describe_tensor)
        engine = TorchTrainerEngine.trainer_init(
            info, client=loopback, source=torch_fp8_source(inner, SPEC, stats=True)
        )
    try:
        first = engine.send_weights()
        (reply,) = loopback.weight_checker("checksum")
        assert reply["checksums"] == _checksums(_expected(weights))
        # the round's report: what the pairs saved, each weight's error on the trainer's device
        assert first.fp8 is not None and first.fp8.weights == len(SPEC)
        halves = sum(weights[n].size for n in SPEC)
        assert first.fp8.bytes_saved == halves - 4 * (6 + 1 + 4)
        assert set(first.fp8.errors) == set(SPEC)
        for name, scheme in SPEC.items():
            x = weights[name]
            q, scale = _expected({name: x}).values()
            want = np.abs(dequantize_reference(q, scale, scheme) - x.astype(np.float32))
            assert first.fp8.errors[name].max_abs_error == pytest.approx(want.max(), rel=1e-6)
            assert first.fp8.errors[name].mean_abs_error == pytest.approx(want.mean(), rel=1e-4)
        assert f"fp8: 3 weights, {first.fp8.bytes_saved / 1e6:.1f} MB saved" in first.summary()
        # one element of down_proj moves: only the e4m3 bytes that change are patched
        name = f"{L0}.mlp.down_proj.weight"
        moved = weights[name].copy()
        moved[5, 7] = ml_dtypes.bfloat16(float(moved[5, 7]) * 1.5 + 0.001)
        weights[name] = moved
        inner.tensors[name] = jnp.asarray(moved) if framework == "jax" else _torch(moved)
        metrics = engine.send_weights()
        assert metrics.density is not None and metrics.wire_bytes < metrics.dense_bytes / 20
        (reply,) = loopback.weight_checker("checksum")
        assert reply["checksums"] == _checksums(_expected(weights))
    finally:
        engine.shutdown()


def _fp8_checkpoint(root: Any, weights: dict[str, np.ndarray], config: dict[str, Any]) -> None:
    """A served FP8 checkpoint of ``weights``: each 2-D ``X.weight`` but the embedding
    quantized as ``config`` says (the reference quantizer: vLLM's bytes), the rest as is."""
    from safetensors.torch import save_file

    from weightwire.shared.quant import scheme_of_config

    scheme = scheme_of_config(config)
    assert isinstance(scheme, Fp8Block)
    out: dict[str, torch.Tensor] = {}
    for name, x in weights.items():
        if x.ndim == 2 and "embed" not in name:
            q, s = quantize_block_reference(name, x, scheme)
            out[name] = torch.from_numpy(q.view(np.uint8).copy()).view(torch.float8_e4m3fn)
            out[name + "_scale_inv"] = torch.from_numpy(s.copy())
        else:
            out[name] = _torch(x)
    root.mkdir()
    save_file(out, str(root / "model.safetensors"))
    (root / "config.json").write_text(json.dumps({"quantization_config": config}))


def test_auto_takes_the_served_models_names_and_scheme() -> None:
    from weightwire.shared.served import ServedModel

    weights = _weights()
    source = jax_fp8_source(DictSource(weights, describe), "auto")
    with pytest.raises(ConfigError, match="learns its spec from the served model at trainer_init"):
        source.metadata()
    served_metas = [
        ParamMeta(m.name, m.dtype, m.shape)
        for m in jax_fp8_source(DictSource(weights, describe), SPEC).metadata()
    ]
    config = {"quant_method": "fp8", "weight_block_size": [64, 64], "scale_fmt": "ue8m0"}
    for_block = [
        ParamMeta(m.name + "_inv" if m.name.endswith("_scale") else m.name, m.dtype, m.shape)
        for m in served_metas
    ]
    source.fit(ServedModel.of(for_block, quantization_config=config))
    assert source.spec == {
        f"{L0}.mlp.down_proj.weight": Fp8Block((64, 64), True),
        f"{L0}.mlp.gate_proj.weight": Fp8Block((64, 64), True),
        f"{L0}.self_attn.o_proj.weight": Fp8Block((64, 64), True),
    }
    with pytest.raises(ServedModelMismatch, match="the servers told no served model"):
        jax_fp8_source(DictSource(weights, describe), "auto").fit(None)
    plain = ServedModel.of(DictSource(weights, describe).metadata(), quantization_config=config)
    with pytest.raises(ServedModelMismatch, match="takes no tensor in FP8"):
        jax_fp8_source(DictSource(weights, describe), "auto").fit(plain)
    with pytest.raises(ServedModelMismatch, match="does not take in FP8"):
        jax_fp8_source(DictSource(weights, describe), SPEC).fit(plain)


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_auto_rounds_deliver_the_served_checkpoints_bytes(
    loopback: Any, framework: str, tmp_path: Any
) -> None:
    """The served FP8 checkpoint (a directory, as a stock vLLM server's) says which weights
    and how; an ``auto`` round's tensors are that checkpoint's, byte for byte."""
    from safetensors.torch import load_file

    weights = _weights(2)
    config = {
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
    }
    _fp8_checkpoint(tmp_path / "fp8", weights, config)
    info = TrainerInitInfo(
        backend="weightwire_tcp",
        served_checkpoint=str(tmp_path / "fp8"),
        timeouts=Timeouts(http_s=60, connect_s=30, warmup_s=30, transfer_s=30),
    )
    engine: Any
    if framework == "jax":
        source = jax_fp8_source(
            DictSource({n: jnp.asarray(a) for n, a in weights.items()}, describe), "auto"
        )
        engine = JAXTrainerEngine.trainer_init(info, client=loopback, source=source)
    else:
        source = torch_fp8_source(
            DictSource({n: _torch(a) for n, a in weights.items()}, describe_tensor), "auto"
        )
        engine = TorchTrainerEngine.trainer_init(info, client=loopback, source=source)
    try:
        assert set(source.spec) == {n for n, a in weights.items() if a.ndim == 2} - {
            "model.embed_tokens.weight"
        }
        engine.send_weights()
        (reply,) = loopback.weight_checker("checksum")
        on_disk = load_file(str(tmp_path / "fp8" / "model.safetensors"))
        # (the loopback receiver keeps what earlier tests of the module sent under other names)
        assert {n: reply["checksums"][n] for n in on_disk} == {
            n: hashlib.sha256(_host(t)).hexdigest() for n, t in on_disk.items()
        }
    finally:
        engine.shutdown()


def test_an_overlapped_round_sends_the_pairs_quantized_at_its_snapshot(loopback: Any) -> None:
    info = TrainerInitInfo(
        backend="weightwire_tcp",
        timeouts=Timeouts(http_s=60, connect_s=30, warmup_s=30, transfer_s=30),
    )
    weights = _weights(3)
    inner = DictSource({n: _torch(a) for n, a in weights.items()}, describe_tensor)
    engine = TorchTrainerEngine.trainer_init(
        info, client=loopback, source=torch_fp8_source(inner, SPEC, stats=True)
    )
    try:
        handle = engine.send_weights(wait=False)
        # the trainer moves on: the round sends what the snapshot quantized
        inner.tensors = {n: _torch(a + 1) for n, a in _weights(4).items()}
        metrics = handle.result(timeout=60)
        (reply,) = loopback.weight_checker("checksum")
        want = _checksums(_expected(weights))
        assert {n: reply["checksums"][n] for n in want} == want
        assert metrics.fp8 is not None and set(metrics.fp8.errors) == set(SPEC)
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("framework", "in_place"), [("jax", False), ("torch", False), ("torch", True)]
)
def test_a_round_with_a_non_finite_weight_fails_naming_it_and_commits_nothing(
    loopback: Any, framework: str, in_place: bool
) -> None:
    info = TrainerInitInfo(
        backend="weightwire_tcp",
        timeouts=Timeouts(http_s=60, connect_s=30, warmup_s=30, transfer_s=30),
        **({"stage_budget_bytes": 0} if in_place else {}),
    )
    # two layer groups: layer 0 is read, quantized and yielded before layer 1's flags
    l1 = "model.layers.1"
    spec = {**SPEC, **{n.replace(L0, l1): s for n, s in SPEC.items()}}
    weights = _weights(5)
    weights = {
        **{n: a for n, a in weights.items() if n != "model.norm.weight"},
        **{n.replace(L0, l1): a + 1 for n, a in weights.items() if L0 in n},
        "model.norm.weight": weights["model.norm.weight"],
    }
    engine: Any
    inner: DictSource
    if framework == "jax":
        inner = DictSource({n: jnp.asarray(a) for n, a in weights.items()}, describe)
        engine = JAXTrainerEngine.trainer_init(
            info, client=loopback, source=jax_fp8_source(inner, spec)
        )
    else:
        inner = DictSource({n: _torch(a) for n, a in weights.items()}, describe_tensor)
        engine = TorchTrainerEngine.trainer_init(
            info, client=loopback, source=torch_fp8_source(inner, spec)
        )
    try:
        engine.send_weights()
        (before,) = loopback.weight_checker("checksum")
        # every tensor of the next round moves; layer 1's down_proj holds a NaN
        bad = f"{l1}.mlp.down_proj.weight"
        moved = {n: (a.astype(np.float32) * 2).astype(a.dtype) for n, a in weights.items()}
        poisoned = dict(moved)
        poisoned[bad] = moved[bad].copy()
        poisoned[bad][3, 4] = np.nan
        wrap = jnp.asarray if framework == "jax" else _torch
        inner.tensors = {n: wrap(a) for n, a in poisoned.items()}
        with pytest.raises(QuantizationError, match=f"'{bad}' holds NaN or inf"):
            engine.send_weights()
        (after,) = loopback.weight_checker("checksum")
        if in_place:
            # layer 0 landed as it arrived; the group holding the NaN never reached the wire
            l1_names = [n for n in before["checksums"] if n.startswith(l1)]
            assert len(l1_names) == 6
            assert {n: after["checksums"][n] for n in l1_names} == {
                n: before["checksums"][n] for n in l1_names
            }
        else:
            assert after["checksums"] == before["checksums"]  # not even layer 0's new bytes
        # the trainer fixes its step: the next round commits every weight
        inner.tensors = {n: wrap(a) for n, a in moved.items()}
        engine.send_weights()
        (fixed,) = loopback.weight_checker("checksum")
        want = {}
        for name, x in moved.items():
            scheme = spec.get(name)
            if scheme is None:
                want[name] = x.tobytes()
            elif isinstance(scheme, Fp8PerTensor):
                q, s = quantize_tensor_reference(name, x)
                want[name], want[name + "_scale"] = q.tobytes(), s.tobytes()
            else:
                q, s = quantize_block_reference(name, x, scheme)
                want[name], want[name + "_scale_inv"] = q.tobytes(), s.tobytes()
        assert {n: fixed["checksums"][n] for n in want} == {
            n: hashlib.sha256(b).hexdigest() for n, b in want.items()
        }
    finally:
        engine.shutdown()


@pytest.mark.parametrize("batched", [False, True], ids=["a-launch-per-group", "one-batch"])
@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_a_pass_launches_and_reads_back_once_per_batch_of_layer_groups(
    framework: str, batched: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from weightwire.jax_side.quant import launch_fp8 as launch_jax
    from weightwire.torch_side.sender.quant import launch_fp8 as launch_torch
    from weightwire.trainer import fp8_source
    from weightwire.trainer.fp8_source import Fp8Source, LaunchedGroup

    if not batched:  # every layer group past the launch's bytes: a launch each
        monkeypatch.setattr(fp8_source, "LAUNCH_BYTES", 1)

    l1 = "model.layers.1"
    spec = {**SPEC, **{n.replace(L0, l1): s for n, s in SPEC.items()}}
    weights = _weights(6)
    weights = {**weights, **{n.replace(L0, l1): a for n, a in weights.items() if L0 in n}}
    launch: Any = launch_jax if framework == "jax" else launch_torch
    wrap: Any = jnp.asarray if framework == "jax" else _torch
    calls: list[list[str]] = []
    settles: list[int] = []

    def counted(items: Any, stats: bool) -> LaunchedGroup:
        calls.append([name for name, _, _ in items])
        launched = launch(items, stats)

        def settle() -> Any:
            settles.append(len(items))
            return launched.settle()

        return LaunchedGroup(launched.pairs, settle)

    describe_any = describe if framework == "jax" else describe_tensor
    source = Fp8Source(
        DictSource({n: wrap(a) for n, a in weights.items()}, describe_any), spec, counted
    )
    groups = list(source.iter_groups())
    got = dict(pair for group in groups for pair in group)
    # one launch and one read per batch of layer groups holding FP8 weights, none per tensor
    first = [n for n in weights if n in spec and n.startswith(L0)]
    second = [n for n in weights if n in spec and n.startswith(l1)]
    assert calls == ([first + second] if batched else [first, second])
    assert settles == ([6] if batched else [3, 3])
    # the inner source's groups come out as they went in, each weight as its pair
    inner = list(source.inner.iter_groups())
    assert [len(g) for g in groups] == [len(g) + sum(1 for n, _ in g if n in spec) for g in inner]
    want = _expected({n: a for n, a in weights.items() if l1 not in n})
    assert all(_host(got[n]) == want[n].tobytes() for n in want)
