"""Property: for any pytree under a generic rule set, metadata and iteration agree element
for element (name, dtype, shape, order), per item and per group."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightwire.jax_side import PytreeSource
from weightwire.jax_side.dtypes import describe
from weightwire.jax_side.naming import Naming, Stacked, Transpose
from weightwire.jax_side.rules import Rule
from weightwire.shared.groups import layerwise_groups

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int32, jnp.int8, jnp.uint8, jnp.bool_]
KEYS = ["a", "b", "layers_0", "layers_1", "0", "1", "kernel", "stack", "w"]

GENERIC = Naming(
    [
        Rule(
            "{p:.*}/kernel", "{p}.weight", Transpose(), optional=True
        ),  # any rank: reverses all axes
        Rule("{p:.*}/stack", "{p}.{layer}.w", Stacked(), optional=True),
        Rule("{p:.*}", "{p}", optional=True),
    ]
)


@st.composite
def leaf(draw: st.DrawFn, key: str):
    shape = draw(st.lists(st.integers(0, 3), min_size=0, max_size=3))
    if key == "stack":
        shape = [draw(st.integers(1, 3)), *shape]
    dtype = draw(st.sampled_from(DTYPES))
    return np.zeros(shape, dtype)


@st.composite
def tree(draw: st.DrawFn, depth: int = 0):
    keys = draw(st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
    out = {}
    for k in keys:
        # "kernel"/"stack" are leaves only, so the rules above see them where they expect
        nest = depth < 2 and k not in ("kernel", "stack") and draw(st.booleans())
        out[k] = draw(tree(depth + 1)) if nest else draw(leaf(k))
    return {"root": out}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(params=tree(), dtype=st.sampled_from([None, "bfloat16", "float32"]), on_device=st.booleans())
def test_metadata_and_iteration_agree(params, dtype, on_device) -> None:
    if on_device:
        import jax

        params = jax.tree_util.tree_map(jnp.asarray, params)
    src = PytreeSource(params, GENERIC, dtype=dtype)
    metas = src.metadata()
    declared = [(m.name, m.dtype, m.shape) for m in metas]
    assert declared == [(n, *describe(a)) for n, a in src]
    assert declared == [(n, *describe(a)) for g in src.iter_groups() for n, a in g]
    layerwise_groups(metas)  # layers contiguous
    assert len(set(n for n, _, _ in declared)) == len(declared)
