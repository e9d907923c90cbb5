"""The FSDP x TP layout and the no-gather guard shared by the sliced-round JAX trainer scripts
(``_sliced_jax_trainer``, ``_sliced_jax_processes``). Importing it initialises no JAX backend:
each script sets its device count before it imports this."""

from __future__ import annotations

from typing import Any

from jax.sharding import PartitionSpec as P

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
