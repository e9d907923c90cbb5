"""``DictSource``: a ``WeightSource`` over a dict of arrays, for tests and benchmarks.

Any array type a trainer engine sends (numpy, jax, torch): the engine's own ``describe``
(e.g. ``weightwire.jax_side.dtypes.describe``) names each array's wire dtype and shape, so the
metadata is what that engine would compute for the same arrays. Framework-free itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from weightwire.shared.meta import ParamMeta
from weightwire.shared.source import WeightSource


class DictSource(WeightSource):
    """Names -> arrays (numpy, jax or torch); ``describe`` comes from the engine."""

    def __init__(
        self, tensors: dict[str, Any], describe: Callable[[Any], tuple[str, tuple[int, ...]]]
    ) -> None:
        self.tensors = tensors
        self._describe = describe
        self.iterations = 0
        """Passes over the source so far (tests count the rounds that read it)."""

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, *self._describe(t)) for n, t in self.tensors.items()]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        self.iterations += 1
        yield from self.tensors.items()
