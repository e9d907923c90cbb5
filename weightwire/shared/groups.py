"""Layer grouping: partition a round's names into one group per decoder layer.

A name keys on its *outermost* integer path segment (``model.layers.3.mlp.experts.7.w1``
-> layer 3), so a MoE layer stays whole and no per-architecture table is needed.
Consecutive un-indexed names (embeddings, final norm, ``lm_head``) form groups of their
own where they appear.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

from weightwire.shared.errors import ConfigError
from weightwire.shared.meta import ParamMeta

T = TypeVar("T")


@functools.lru_cache(maxsize=1 << 16)  # the same names every round, on both ends' per-tensor path
def layer_key(name: str) -> str | None:
    """The prefix through the outermost index (``model.layers.3``), or None."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        # ASCII only: str.isdigit() also accepts '²' and other Unicode digits.
        if part.isascii() and part.isdigit():
            return ".".join(parts[: i + 1])
    return None


def layerwise_groups(metadata: Sequence[ParamMeta]) -> list[list[ParamMeta]]:
    """Groups in metadata order; a layer whose names are not contiguous is an error.

    Raises ``ValueError`` naming the first name that reopens an already-closed layer,
    because a consumer that frees a layer when its group ends would otherwise wait
    forever for the straggler.
    """
    groups: list[list[ParamMeta]] = []
    keys: list[str | None] = []
    closed: set[str] = set()
    for meta in metadata:
        key = layer_key(meta.name)
        if groups and key == keys[-1]:
            groups[-1].append(meta)
            continue
        if key is not None and key in closed:
            raise ConfigError(
                f"{meta.name!r} belongs to {key!r}, whose names are not contiguous in metadata "
                "order; reorder the source so each layer's tensors are adjacent"
            )
        if groups and keys[-1] is not None:
            closed.add(keys[-1])
        groups.append([meta])
        keys.append(key)
    return groups


def batch_by_layer(pairs: Iterable[tuple[str, T]]) -> Iterator[list[tuple[str, T]]]:
    """Batch a ``(name, value)`` stream into runs sharing a ``layer_key`` (one decoder
    layer, or one run of un-indexed names), in stream order. Only the batch being
    built is referenced, so a consumer that drops each batch bounds memory to a layer."""
    batch: list[tuple[str, T]] = []
    key: object = object()
    for name, value in pairs:
        k = layer_key(name)
        if batch and k != key:
            yield batch
            batch = []
        key = k
        batch.append((name, value))
    if batch:
        yield batch
