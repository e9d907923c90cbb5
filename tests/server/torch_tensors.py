"""A ``WeightSource`` over a dict of torch tensors, sent as they are (the server tests'
trainers send a checkpoint's tensors, edited)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from weightwire.shared.meta import ParamMeta
from weightwire.shared.source import WeightSource


class Tensors(WeightSource):
    def __init__(self, tensors: dict[str, Any]) -> None:
        self.tensors = tensors

    def metadata(self) -> list[ParamMeta]:
        from weightwire.torch_side.dtypes import wire_name

        return [ParamMeta(n, wire_name(t.dtype), tuple(t.shape)) for n, t in self.tensors.items()]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        yield from self.tensors.items()
