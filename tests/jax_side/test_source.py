"""PytreeSource: the WeightSource contract on one device."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import weightwire.jax_side.source as source_mod
from weightwire.jax_side import PytreeSource, preset
from weightwire.jax_side.dtypes import describe, jax_dtype, wire_name
from weightwire.jax_side.naming import Naming, Transpose
from weightwire.jax_side.rules import Rule
from weightwire.shared import SUPPORTED_DTYPES, SourceMismatch
from weightwire.shared.errors import ConfigError
from weightwire.shared.groups import layerwise_groups
from weightwire.tools.models import llama

CFG = llama.config(
    hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2
)


@pytest.fixture(scope="module")
def scanned() -> tuple[dict, object]:
    cfg = CFG.replace(scan_layers=True)
    return llama.init(jax.random.key(0), cfg), cfg


def unroll(scanned_params: dict, layers: int) -> dict:
    """The unrolled-layout pytree holding exactly the scanned model's values."""
    inner = dict(scanned_params["params"]["model"])
    stack = inner.pop("layers")
    for i in range(layers):
        inner[f"layers_{i}"] = jax.tree_util.tree_map(lambda x, i=i: x[i], stack)
    return {"params": {**scanned_params["params"], "model": inner}}


def host(pairs) -> list[tuple[str, np.ndarray]]:
    return [(n, np.asarray(a)) for n, a in pairs]


def test_metadata_and_construction_make_no_transfer(scanned) -> None:
    params, cfg = scanned
    with jax.transfer_guard("disallow"):
        src = PytreeSource(params, llama.naming(cfg), dtype="bfloat16")
        metas = src.metadata()
    assert metas[0].name == "model.embed_tokens.weight" and metas[0].shape == (128, 32)
    assert (
        metas[1].name == "model.layers.0.self_attn.q_proj.weight" and metas[1].dtype == "bfloat16"
    )
    assert metas[-1].name == "lm_head.weight" and metas[-1].shape == (128, 32)
    # a layer is contiguous: grouping accepts the order
    assert [len(g) for g in layerwise_groups(metas)] == [1, 9, 9, 2]


def test_iteration_matches_metadata_and_lives_on_target_device(scanned) -> None:
    params, cfg = scanned
    src = PytreeSource(params, llama.naming(cfg), dtype="bfloat16")
    metas = src.metadata()
    with jax.transfer_guard("disallow"):  # transforms run on device: no host round trip
        pairs = list(src)
    assert [(m.name, m.dtype, m.shape) for m in metas] == [(n, *describe(a)) for n, a in pairs]
    assert all(a.sharding.device_set == {jax.local_devices()[0]} for _, a in pairs)
    assert src.held_names() is None


def test_scanned_and_unrolled_map_to_same_names_and_values(scanned) -> None:
    params, cfg = scanned
    a = host(PytreeSource(params, llama.naming(cfg)))
    b = host(
        PytreeSource(
            unroll(params, cfg.num_hidden_layers), llama.naming(cfg.replace(scan_layers=False))
        )
    )
    assert [n for n, _ in a] == [n for n, _ in b]
    for (name, x), (_, y) in zip(a, b, strict=True):
        assert x.tobytes() == y.tobytes(), name
    q1 = dict(a)["model.layers.1.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(
        q1, np.asarray(params["params"]["model"]["layers"]["self_attn"]["q_proj"]["kernel"][1]).T
    )


def test_iter_groups_one_jitted_call_per_group_and_compiles_once_per_shape(
    scanned, monkeypatch
) -> None:
    params, cfg = scanned
    monkeypatch.setattr(source_mod, "_COMPILED", {})
    calls = []
    real = source_mod._compiled

    def counting(signature):
        fn = real(signature)

        def wrapped(*args):
            calls.append(len(signature))
            return fn(*args)

        return wrapped

    monkeypatch.setattr(source_mod, "_compiled", counting)
    src = PytreeSource(params, llama.naming(cfg), dtype="bfloat16")
    groups = list(src.iter_groups())
    assert [[n for n, _ in g] for g in groups] == [[m.name for m in g] for g in src.groups()]
    assert calls == [1, 9, 9, 2]  # one call per group, each building the whole group
    # both layers share one signature and one compiled executable
    layer_fns = [fn for sig, fn in source_mod._COMPILED.items() if len(sig) == 9]
    assert len(layer_fns) == 1 and layer_fns[0]._cache_size() == 1
    flat = [(n, np.asarray(a).tobytes()) for g in groups for n, a in g]
    assert flat == [(n, np.asarray(a).tobytes()) for n, a in src]


def test_a_later_pass_uploads_nothing_and_yields_the_same(scanned, monkeypatch) -> None:
    """The stacked layers' index vectors go to the device once, not every round."""
    params, cfg = scanned
    src = PytreeSource(params, llama.naming(cfg), dtype="bfloat16")
    src.metadata()
    first = [(n, np.asarray(a).tobytes()) for g in src.iter_groups() for n, a in g]
    puts = []
    real = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: puts.append(a) or real(*a, **k))
    src.metadata()
    again = [(n, np.asarray(a).tobytes()) for g in src.iter_groups() for n, a in g]
    assert again == first and puts == []


def test_fresh_pass_from_live_callable_and_arrays_stay_valid() -> None:
    state = {"params": {"w": {"kernel": jnp.ones((2, 3))}}}
    naming = Naming([Rule("w/kernel", "w.weight", Transpose())])
    src = PytreeSource(lambda: state["params"], naming)
    first = dict(src)
    state["params"] = {
        "w": {"kernel": jnp.full((2, 3), 7.0)}
    }  # a training step replaced the params
    second = dict(src)
    np.testing.assert_array_equal(np.asarray(first["w.weight"]), np.ones((3, 2)))
    np.testing.assert_array_equal(np.asarray(second["w.weight"]), np.full((3, 2), 7.0))
    assert not state["params"]["w"]["kernel"].is_deleted()  # nothing donated


def test_untransformed_leaf_is_handed_out_without_copy() -> None:
    leaf = jnp.arange(4.0)
    ((name, out),) = list(PytreeSource({"b": leaf}, Naming([Rule("b", "b")])))
    assert out is leaf


def test_shape_change_after_metadata_is_caught_naming_the_tensor() -> None:
    state = {"a": jnp.zeros((2,)), "b": jnp.zeros((2,))}
    src = PytreeSource(lambda: state, Naming([Rule("{x}", "{x}")]))
    src.metadata()
    state["b"] = jnp.zeros((3,))
    with pytest.raises(
        SourceMismatch, match=r"index 1: declared 'b' float32 \[2\], got 'b' float32 \[3\]"
    ):
        list(src)
    state["b"] = jnp.zeros((2,), jnp.bfloat16)
    with pytest.raises(SourceMismatch, match=r"declared 'b' float32 \[2\], got 'b' bfloat16 \[2\]"):
        list(src.iter_groups())
    src.metadata()  # a new declaration re-arms it
    assert [describe(a) for _, a in src] == [("float32", (2,)), ("bfloat16", (2,))]


def test_checks_own_stream_only_for_what_metadata_last_declared() -> None:
    # The engine skips its own checked_iter exactly when this says True: the source's
    # passes are checked against that list already (one check per tensor, not two).
    state = {"a": jnp.zeros((2,)), "b": jnp.zeros((2,))}
    src = PytreeSource(lambda: state, Naming([Rule("{x}", "{x}")]))
    assert not src.checks_own_stream(src._metas)  # nothing declared yet: nothing checks against it
    metas = src.metadata()
    assert src.checks_own_stream(metas)
    assert not src.checks_own_stream(
        metas[:1]
    )  # a subset (e.g. one broadcaster's turn) is not the same list
    state["b"] = jnp.zeros((3,))
    assert src.checks_own_stream(
        metas
    )  # still the declared list: the pass below raises, not the engine
    with pytest.raises(SourceMismatch, match="declared 'b' float32 \\[2\\]"):
        list(src.iter_groups())
    redeclared = src.metadata()  # b is (3,) now
    assert src.checks_own_stream(redeclared) and not src.checks_own_stream(metas)


def test_host_numpy_leaves_and_device_choice() -> None:
    naming = Naming([Rule("w", "w", Transpose())])
    ((_, out),) = list(
        PytreeSource({"w": np.arange(6.0, dtype=np.float32).reshape(2, 3)}, naming, device=0)
    )
    np.testing.assert_array_equal(np.asarray(out), np.arange(6.0).reshape(2, 3).T)
    with pytest.raises(ValueError, match="device index 5 out of range"):
        PytreeSource({"w": np.zeros(2)}, naming, device=5)


def test_bad_dtype_arguments() -> None:
    """Each a ``ConfigError`` (a ``ValueError``), as every refusal of the user's input: a
    leaf of a dtype no wire carries (complex64, int4) was a bare ``ValueError``."""
    naming = Naming([Rule("w", "w")])
    with pytest.raises(ConfigError, match="unsupported dtype|has no wire name|is not a dtype"):
        PytreeSource({"w": jnp.zeros(2)}, naming, dtype="float13")
    if not jax.config.read("jax_enable_x64"):
        with pytest.raises(ConfigError, match="float64 needs jax_enable_x64"):
            PytreeSource({"w": jnp.zeros(2)}, naming, dtype="float64")
    with pytest.raises(ConfigError, match=r"HF tensor 'w'.*int4 has no wire name"):
        PytreeSource({"w": jnp.zeros(2, jnp.int4)}, naming)
    with pytest.raises(ConfigError, match=r"HF tensor 'w'.*complex64 has no wire name"):
        PytreeSource({"w": jnp.zeros(2, jnp.complex64)}, naming)
    with pytest.raises(TypeError, match="naming must be a weightwire Naming"):
        PytreeSource({"w": jnp.zeros(2)}, {"w": "w"})


def test_wire_dtype_mapping_covers_the_table() -> None:
    expected = {
        "bfloat16": jnp.bfloat16,
        "float16": jnp.float16,
        "float32": jnp.float32,
        "float64": np.float64,
        "int8": jnp.int8,
        "uint8": jnp.uint8,
        "int32": jnp.int32,
        "int64": np.int64,
        "float8_e4m3fn": jnp.float8_e4m3fn,
        "float8_e5m2": jnp.float8_e5m2,
        "bool": jnp.bool_,
    }
    assert set(expected) == set(SUPPORTED_DTYPES)
    for name, dtype in expected.items():
        assert wire_name(dtype) == name
    assert wire_name(ml_dtypes.bfloat16) == "bfloat16"
    assert jax_dtype("float8_e4m3fn") == np.dtype(ml_dtypes.float8_e4m3fn)
    with pytest.raises(ValueError, match="float8_e4m3fnuz has no wire name"):
        wire_name(jnp.float8_e4m3fnuz)
    # every 32-bit-or-narrower wire dtype survives a source cast and is described back
    for name in ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2"):
        ((_, a),) = list(PytreeSource({"w": jnp.ones(3)}, Naming([Rule("w", "w")]), dtype=name))
        assert describe(a) == (name, (3,))


def test_import_is_light_and_never_loads_torch() -> None:
    code = textwrap.dedent("""
        import importlib.util, json, sys
        import weightwire.jax_side as js
        light = not any(m in sys.modules for m in ("jax", "torch", "flax"))
        js.PytreeSource, js.preset, js.Naming
        import weightwire.tools.models.llama, weightwire.tools.models.gpt2
        import weightwire.tools.models.gemma, weightwire.tools.models.qwen2
        import weightwire.tools.models.qwen3
        engine = importlib.util.find_spec("weightwire.jax_side.engine") is not None
        if engine:
            js.JAXTrainerEngine
        print(json.dumps({"light": light, "torch": "torch" in sys.modules, "engine": engine}))
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["light"] is True
    assert result["torch"] is False, "weightwire.jax_side imported torch"


def test_preset_accepts_inner_params_dict_too(scanned) -> None:
    params, cfg = scanned
    names_outer = [m.name for m in PytreeSource(params, llama.naming(cfg)).metadata()]
    names_inner = [
        m.name for m in PytreeSource(params["params"], preset("llama", scan_layers=True)).metadata()
    ]
    assert names_outer == names_inner


def test_preset_drops_rotary_tables(scanned) -> None:
    params, cfg = scanned
    with_cache = {
        "params": {
            **params["params"],
            "model": {**params["params"]["model"], "rotary_emb": {"inv_freq": jnp.ones(4)}},
        }
    }
    plain = PytreeSource(params, llama.naming(cfg)).metadata()
    src = PytreeSource(with_cache, llama.naming(cfg))
    assert src.metadata() == plain
    assert src._plan.dropped == ("params/model/rotary_emb/inv_freq",)
