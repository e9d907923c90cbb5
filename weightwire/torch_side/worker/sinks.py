"""Which ``PatchSink`` a worker's round uses (``delta``), decided at the first update that
takes the patch step (``_ReceiverCore._patch_step``: an update with patches, or any update of
a session that declared delta rounds; a dense round of another session never comes here).

- a model that patches itself (``patch_weights``: ``HFModelHost``) -> ``ModelSink``;
- a worker given a loader-map provider (vLLM) whose map of the model was recorded ->
  ``MapSink`` (recorded once per model, kept across sessions; a refusal is kept too);
- otherwise, while the session's trainer declared delta rounds -> ``CopySink`` over the
  model's host copy (``WeightState``), which every round then keeps current;
- otherwise none: a delta round is refused (``DeltaBaseMismatch``), the trainer sends dense.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import cast

import torch

from weightwire.shared.delta import Patch
from weightwire.shared.groups import layer_key
from weightwire.shared.meta import ParamMeta
from weightwire.shared.update_info import UpdateInfo
from weightwire.torch_side.dtypes import wire_name
from weightwire.torch_side.worker.delta import (
    PatchSink,
    PatchSplitter,
    RoundDelta,
    StagedPatch,
    dense_names,
    logical_metas,
    patch_tensor,
    refuse,
)
from weightwire.torch_side.worker.landing import LoaderMap, MapLookup, tied_aliases
from weightwire.torch_side.worker.load import Model, Pairs, PatchingModel, RoundPlan
from weightwire.torch_side.worker.spec import ModelSpec
from weightwire.torch_side.worker.weight_state import HostCopy, WeightState

log = logging.getLogger(__name__)


class ModelSink(PatchSink):
    """The model patches itself inside its own round (``HFModelHost.patch_weights``)."""

    name = "model"

    def __init__(self, model: Model) -> None:
        tied = getattr(model, "tied_aliases", None)
        self.aliases = tied() if callable(tied) else {}

    def in_round(self, model: Model, patches: Sequence[StagedPatch]) -> None:
        if patches:
            cast(PatchingModel, model).patch_weights(patches)  # the model it was made for


class MapSink(PatchSink):
    """A recorded ``LoaderMap``: patches written straight into the serving parameters, after
    the round's dense tensors; under a framework that reloads whole layers, the unsent
    tensors of a layer the round loads are read back from the parameters and loaded too."""

    name = "loader_map"
    writes_live = True

    def __init__(
        self, loader_map: LoaderMap, aliases: dict[str, str], *, whole_layers: bool
    ) -> None:
        self.map = loader_map
        self._aliases = self.aliases = aliases
        self.completes_layers = whole_layers
        self._mates_read: dict[str, torch.Tensor] = {}

    def _target(self, name: str) -> str:
        return name if name in self.map.tensors else self._aliases.get(name, name)

    def _mates(self, loaded: set[str]) -> set[str]:
        if not self.completes_layers:
            return set()
        keys = {layer_key(n) for n in loaded} - {None}
        return {n for n in self.map.tensors if layer_key(n) in keys} - loaded

    def _readable(self, name: str) -> bool:
        """This rank holds all of the tensor (``LoaderMap.read`` can rebuild it)."""
        return bool(self.map.tensors[name].complete)

    def refusal(self, dense: Sequence[str], patches: Sequence[Patch]) -> str | None:
        """Also reads the unsent tensors of the layers this update loads, now: once a
        framework round opened, the parameters are not readable until it commits."""
        named = [*dense, *(p.name for p in patches)]
        missing = [n for n in named if self._target(n) not in self.map.tensors]
        if missing:
            return f"the loader map has no landing for {missing[0]!r}"
        mates = self._mates({self._target(n) for n in dense}) - set(self._mates_read)
        unreadable = sorted(n for n in mates if not self._readable(n))
        if unreadable:
            return (
                f"{unreadable[0]!r} is not sent but its layer is, and this rank holds only "
                "part of it (cannot reload the layer whole)"
            )
        for name in sorted(mates):
            tensor = self.map.read(name)
            if tensor.device.type == "meta":
                return f"{name!r} cannot be read back while the round is applied in place"
            self._mates_read[name] = tensor
        return None

    def completion(self, loaded: set[str], patches: Sequence[StagedPatch]) -> Pairs:
        targets = {self._target(n) for n in loaded}
        return [(n, t) for n, t in sorted(self._mates_read.items()) if n not in targets]

    def after_commit(self, patches: Sequence[StagedPatch]) -> None:
        checked: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        for p in patches:
            target = self._target(p.name)
            # Indices were checked against the patch's shape on receipt (``PatchSplitter``):
            # in range of the target too when the two hold as many elements.
            if math.prod(self.map.tensors[target].shape) == p.numel:
                checked.append((target, p.index, p.values))
            else:
                self.map.patch(target, p.index, p.values)
        self.map.patch_all(checked)  # one scatter per parameter storage where it lands whole


class CopySink(PatchSink):
    """The fallback: patched tensors rebuilt from the host copy and loaded whole."""

    name = "host_copy"

    def __init__(self, copy: HostCopy, *, whole_layers: bool, layout: Callable[[], set[str]]):
        self.copy = copy
        self.completes_layers = whole_layers
        """The framework reloads whole layers: every tensor of a loaded layer is loaded."""
        self._layout = layout  # every checkpoint tensor name of the model
        self._touched: set[str] = set()

    def _layer_mates(self, names: set[str]) -> set[str]:
        if not self.completes_layers:
            return set()
        keys = {layer_key(n) for n in names} - {None}
        return {n for n in self._layout() | set(self.copy.tensors) if layer_key(n) in keys}

    def refusal(self, dense: Sequence[str], patches: Sequence[Patch]) -> str | None:
        patched = {p.name for p in patches}
        need = patched | (self._layer_mates(patched | set(dense)) - set(dense))
        missing = sorted(n for n in need if n not in self.copy.tensors)
        if missing:
            return f"the worker's host copy does not hold {missing[0]!r}"
        for p in patches:
            held = self.copy.tensors[p.name]
            if tuple(held.shape) != p.shape or wire_name(held.dtype) != p.dtype:
                return f"the worker's host copy of {p.name!r} is {held.dtype} {list(held.shape)}"
        return None

    @property
    def observe_fn(self) -> Callable[[Pairs], None] | None:
        return self.observe

    def observe(self, pairs: Pairs) -> None:
        for name, tensor in pairs:
            self._touched.add(name)
            self.copy.tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()

    def completion(self, loaded: set[str], patches: Sequence[StagedPatch]) -> Pairs:
        out: Pairs = []
        for p in patches:
            self._touched.add(p.name)
            base = self.copy.tensors[p.name]
            patch_tensor(base, p.index, p.values)
            out.append((p.name, base))
        rebuilt = {p.name for p in patches}
        for name in sorted(self._layer_mates(loaded | rebuilt) - loaded - rebuilt):
            out.append((name, self.copy.tensors[name]))
        return out

    def round_failed(self) -> None:
        # What the failed round touched may differ from the model now: a later patch on it
        # is refused (the trainer then sends it dense) instead of built on a wrong base.
        for name in self._touched:
            self.copy.tensors.pop(name, None)
        self._touched.clear()

    def after_commit(self, patches: Sequence[StagedPatch]) -> None:
        self._touched.clear()  # the copy now holds what the model holds


class SinkChooser:
    """Picks each round's sink; holds the recorded loader maps (one per target model)."""

    def __init__(
        self,
        weights: WeightState,
        maps: MapLookup | None,
        *,
        whole_layers: bool,
        spec: Callable[[], ModelSpec | None],
    ) -> None:
        self._weights = weights
        self._maps = maps
        self._seen: dict[int, dict[str, ParamMeta]] = {}
        """Per target model (by id; its map is cached by the core): every tensor seen."""
        self._whole_layers = whole_layers
        self._spec = spec
        self.delta_rounds = False
        self.why_none = "delta rounds are off on this worker (the trainer did not declare them)"

    def session(self, delta_rounds: bool) -> None:
        """A trainer's init (the core forgot the held round; without delta rounds it freed
        the host copies too)."""
        self.delta_rounds = delta_rounds

    def open(
        self, model: Model, metas: Sequence[ParamMeta], patches: Sequence[Patch], *, first: bool
    ) -> RoundDelta:
        """A round's delta part, at the first update that takes the patch step. ``first``:
        that is the round's first update; a later one (a dense update came first, in a session
        without delta rounds) gets a sink only from a model that patches itself."""
        if first:
            return RoundDelta(self.choose(model, metas, patches))
        return RoundDelta(ModelSink(model) if isinstance(model, PatchingModel) else None)

    def admit(
        self,
        delta: RoundDelta,
        model: Model,
        update: UpdateInfo,
        plan: RoundPlan,
        patches: Sequence[Patch],
    ) -> PatchSplitter | None:
        """Check, before any byte, that the round's sink can apply this update (the base it
        patches, the tensors it reloads); returns the splitter that holds its patches (None:
        nothing for a sink)."""
        sink = delta.sink
        held = self._weights.token(model)
        if patches and sink is None:
            raise refuse(update.delta_base or "", held, self.why_none)
        if sink is None:
            return None
        why = sink.refusal(dense_names(plan.metas, patches), patches)
        if why is not None and patches:
            raise refuse(update.delta_base or "", held, why)
        if why is not None:
            raise ValueError(f"this worker cannot apply the round: {why}")
        if patches and isinstance(model, PatchingModel):
            model.check_patches(patches)
        return PatchSplitter(patches, observe=sink.observe_fn)

    def choose(
        self, model: Model, metas: Sequence[ParamMeta], patches: Sequence[Patch]
    ) -> PatchSink | None:
        if isinstance(model, PatchingModel):
            return ModelSink(model)
        if not (self.delta_rounds or patches):
            return None
        spec = self._spec()
        if self._maps is not None:
            # The whole checkpoint where known, else every tensor seen (the first, dense round
            # lists them all): a map of some tensors of a parameter is refused.
            seen = self._seen.setdefault(id(model), {})
            for m in logical_metas(metas, patches):
                seen.setdefault(m.name, m)
            whole = (
                [ParamMeta(n, t.dtype, t.shape) for n, t in spec.tensors.items()] if spec else []
            )
            found = self._maps(whole or list(seen.values()))
            if found is not None:
                # A recorded map: the model is a torch module.
                aliases = tied_aliases(cast(torch.nn.Module, model))
                return MapSink(found, aliases, whole_layers=self._whole_layers)
            self.why_none = (
                "the loader map was refused (see the worker's log) and delta rounds are off"
            )
        if self.delta_rounds:
            names = set(spec.tensors) if spec is not None else set()
            sink = CopySink(
                self._weights.host_copy(model),
                whole_layers=self._whole_layers,
                layout=lambda: names,
            )
            if isinstance(model, torch.nn.Module):
                sink.aliases = tied_aliases(model)
            return sink
        return None
