"""The FSDP x TP layout, the trainer's source over it and the no-gather guard shared by the
sliced-round JAX trainer scripts (``_sliced_jax_trainer``, ``_sliced_jax_processes``,
``_sliced_delta_jax_mesh``). Importing it initialises no JAX backend: each script sets its
device count before it imports this."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from weightwire.jax_side import placement
from weightwire.jax_side.dtypes import describe
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.jax_side.naming import Naming
from weightwire.jax_side.rules import Rule
from weightwire.jax_side.source import PytreeSource
from weightwire.jax_side.transforms import Transpose
from weightwire.testing.sources import DictSource

O_PROJ = "model.layers.0.self_attn.o_proj.weight"


def spec_for(name: str, shape: tuple[int, ...]) -> P:
    """FSDP on the rows, TP on the columns where they divide; the rest replicated."""
    if "norm" in name or "mlp.gate." in name:
        return P()
    axes: list[str | None] = [None] * len(shape)
    if shape[0] % 4 == 0:
        axes[0] = "fsdp"
    if len(shape) > 1 and shape[-1] % 2 == 0:
        axes[-1] = "tp"
    return P(*axes)


def forbidden(what: str) -> Any:
    """A stand-in for a gather entry point that fails the round if it is called."""

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError(f"{what} during a sliced round: a whole sharded array was asked")

    return refuse


@contextlib.contextmanager
def gathers_refused(device_get: Callable[[Any], Any]) -> Iterator[None]:
    """Every gather entry point (``jax_side.placement``: ``Target.move``, ``_replicate_on``;
    the engine's whole-tensor ``host_bytes``) raising, and ``jax.device_get`` replaced by
    ``device_get`` (a recorder of the host copies), for the block."""
    saved = (placement.Target.move, placement._replicate_on, JAXTrainerEngine.host_bytes)
    real_get = jax.device_get
    placement.Target.move = forbidden("Target.move")  # type: ignore[method-assign]
    placement._replicate_on = forbidden("_replicate_on")  # type: ignore[assignment]
    JAXTrainerEngine.host_bytes = forbidden("host_bytes")  # type: ignore[method-assign]
    jax.device_get = device_get
    try:
        yield
    finally:
        placement.Target.move, placement._replicate_on = saved[0], saved[1]
        JAXTrainerEngine.host_bytes = saved[2]  # type: ignore[method-assign]
        jax.device_get = real_get


def mesh_source(arrays: dict[str, Any], kind: str) -> Any:
    """The trainer's source over the live dict ``arrays``: ``dict``, the arrays themselves;
    ``pytree``, a ``PytreeSource`` over them with ``o_proj`` held as a Flax kernel and
    transposed back by a jitted rule on its shards."""
    if kind != "pytree":
        return DictSource(arrays, describe)
    return PytreeSource(
        lambda: {
            "o_kernel": arrays[O_PROJ].T,
            **{n: a for n, a in arrays.items() if n != O_PROJ},
        },
        Naming([Rule("o_kernel", O_PROJ, Transpose()), Rule("{x}", "{x}")]),
    )
