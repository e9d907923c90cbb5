"""``jax_side.dtypes.describe``: what ``checked_iter`` compares against a round's metadata, the
same for a ``jax.Array`` (read from its abstract value), a ShapeDtypeStruct and a numpy
array; ``is_array`` is ``isinstance(x, jax.Array)``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from weightwire.jax_side.dtypes import describe, is_array


def test_describe_reads_the_same_from_every_kind_of_tensor() -> None:
    for dtype, name in ((jnp.bfloat16, "bfloat16"), (jnp.float32, "float32"), (jnp.int8, "int8")):
        for shape in ((), (3,), (2, 5, 7)):
            array = jnp.zeros(shape, dtype)
            spec = jax.ShapeDtypeStruct(shape, dtype)
            host = np.zeros(shape, ml_dtypes.bfloat16 if dtype is jnp.bfloat16 else dtype)
            for x in (array, spec, host, array):  # the array twice: its type then known
                got = describe(x)
                assert got == (name, shape) and type(got[1]) is tuple
                assert all(type(d) is int for d in got[1])


def test_is_array_is_isinstance_jax_array() -> None:
    for x in (jnp.ones(2), jnp.ones(2), jax.device_put(np.ones(3))):
        assert is_array(x)
    for x in (np.ones(2), jax.ShapeDtypeStruct((2,), jnp.float32), 1.0, [jnp.ones(2)]):
        assert not is_array(x)
