"""``Fp8Source``: a source whose round sends the named ``X.weight``s in FP8.

Wraps any ``WeightSource``: each ``X.weight`` the spec names becomes its checkpoint pair
(``X.weight`` in ``float8_e4m3fn`` + ``X.weight_scale_inv`` / ``X.weight_scale``, in that
order, where the weight was), quantized as it is read by the framework's quantizer
(``jax_side.quant.fp8_source``, ``torch_side.sender.quant.fp8_source`` bind theirs), one
launch and one device read per batch of layer groups; every other tensor passes unchanged.
Framework-free: the quantizer is a callable.

The spec is checked against the source's metadata up front (a name the source lacks, a
tensor the scheme cannot take: ``QuantizationError`` naming it, before any rendezvous),
then at ``trainer_init`` against what the served model told (``fit``:
``ServedModel.check_fp8_spec``, ``ServedModelMismatch`` naming the tensors). ``spec="auto"``
is the served model's own list: which names it takes in FP8 and with which scheme, read at
``trainer_init``, never guessed (a server that tells nothing: refused).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, NamedTuple

from weightwire.shared.dtypes import wire_dtype
from weightwire.shared.errors import ConfigError
from weightwire.shared.meta import ParamMeta
from weightwire.shared.quant import (
    Fp8Scheme,
    QuantizationError,
    QuantStats,
    check_input,
    fp8_metas,
    fp8_names,
)
from weightwire.shared.served import ServedModel, ServedModelMismatch
from weightwire.shared.source import WeightSource
from weightwire.trainer.metrics import Fp8Report

LAUNCH_BYTES = 1 << 30
"""Bytes of source weights one quantization launch takes at least (but its last): about
two Llama-3-8B layers' linears; the outputs of two batches are alive at once."""


class LaunchedGroup(NamedTuple):
    """One layer group's FP8 weights, quantized by one launch on the trainer's device: the
    arrays may still be computing; ``settle`` reads the group's finite flags (and errors)
    back in one device read and raises ``QuantizationError`` naming every weight that holds
    NaN or inf."""

    pairs: list[tuple[Any, Any]]  # (e4m3 weight, float32 scale) per quantized weight
    settle: Callable[[], list[QuantStats | None]]


QuantizeGroup = Callable[[Sequence[tuple[str, Any, Fp8Scheme]], bool], LaunchedGroup]
"""``([(name, tensor, scheme), ...], stats) -> LaunchedGroup``: a framework's
``launch_fp8`` (no host sync until ``settle``)."""


class Fp8Source(WeightSource):
    """``inner`` with the ``spec``'s weights (name -> scheme) sent as FP8 checkpoint pairs.

    ``spec="auto"``: the names and scheme the served model tells at ``trainer_init``
    (``fit``); until then the source has no metadata.
    ``stats``: after each pass, ``last_stats`` holds every quantized weight's error (read
    with the group's finite flags). ``bytes_saved()``: what the quantized tensors save per round.
    """

    def __init__(
        self,
        inner: WeightSource,
        spec: Mapping[str, Fp8Scheme] | Literal["auto"],
        quantize: QuantizeGroup,
        *,
        stats: bool = False,
    ) -> None:
        self.inner = inner
        self.auto = isinstance(spec, str)
        if self.auto and spec != "auto":
            raise QuantizationError(f"an FP8 spec maps names to schemes, or is 'auto': {spec!r}")
        self.spec: dict[str, Fp8Scheme] = {} if isinstance(spec, str) else dict(spec)
        self._resolved = not self.auto
        self._quantize = quantize
        self.stats = stats
        self.last_stats: dict[str, QuantStats] = {}
        for name, scheme in self.spec.items():
            fp8_names(name, scheme)  # an X.weight name, or refused
        if not self.auto:
            self._check(inner.metadata())

    @property
    def awaits_served(self) -> bool:
        """``"auto"`` before ``fit``: no spec yet, so no metadata of its own (the inner
        source's names are what it holds)."""
        return self.auto and not self._resolved

    def __repr__(self) -> str:
        what = "auto" if self.awaits_served else f"{len(self.spec)} weights"
        return f"Fp8Source({self.inner!r}, {what})"

    def over(self, inner: WeightSource) -> Fp8Source:
        """This source quantizing ``inner`` instead: a framework's view of the inner source
        (a sliced round's, left sharded; an overlapped round's snapshot), quantized on the
        round's thread as the round reads it. The spec and the stats are shared: ``report``
        of this source tells the last pass of either."""
        twin = copy.copy(self)
        twin.inner = inner
        return twin

    def fit(self, served: ServedModel | None) -> None:
        """At ``trainer_init``, once the servers told their model: ``auto`` takes its FP8
        names and scheme; an explicit spec must match them. ``ServedModelMismatch`` naming
        the tensors; a server that told nothing leaves an explicit spec unchecked."""
        if not self.auto:
            if served is not None:
                served.check_fp8_spec(self.spec)
            return
        if served is None or served.fp8 is None:
            why = (
                "the servers told no served model (stock vLLM's workers tell nothing; pass "
                "TrainerInitInfo(served_checkpoint=<the FP8 checkpoint's directory>))"
                if served is None
                else "the served model takes no tensor in FP8 (its quantization_config is not "
                "quant_method 'fp8', or its weights were dequantized on load)"
            )
            raise ServedModelMismatch(
                f"fp8_source(source, 'auto') quantizes what the served model takes in FP8, and "
                f"{why}: send the source unquantized, or pass the spec explicitly"
            )
        sent = {m.name for m in self.inner.metadata()}
        self.spec = {n: served.fp8.scheme for n in sorted(served.fp8.weights) if n in sent}
        self._check(self.inner.metadata())
        self._resolved = True

    def _spec(self) -> dict[str, Fp8Scheme]:
        if not self._resolved:
            raise ConfigError(
                "fp8_source(source, 'auto') learns its spec from the served model at "
                "trainer_init (a TrainerGroup's other ranks: from rank 0's): give the source "
                "to trainer_init before using it, or pass the spec explicitly (the served "
                "model's fp8 weights and scheme)"
            )
        return self.spec

    def _check(self, metas: list[ParamMeta]) -> None:
        by_name = {m.name: m for m in metas}
        missing = sorted(set(self.spec) - set(by_name))
        if missing:
            raise QuantizationError(
                f"the FP8 spec names {missing[0]!r}, which the source does not send "
                f"({len(missing)} such name(s)): fix the spec or the source's naming"
            )
        for name, scheme in self.spec.items():
            meta = by_name[name]
            check_input(name, meta.dtype, meta.shape, scheme)
            clash = set(fp8_names(name, scheme)[1:]) & set(by_name)
            if clash:
                raise QuantizationError(
                    f"the source already sends {min(clash)!r} beside {name!r}: "
                    f"quantizing {name!r} would send it twice"
                )

    def metadata(self) -> list[ParamMeta]:
        spec = self._spec()
        out: list[ParamMeta] = []
        for meta in self.inner.metadata():
            scheme = spec.get(meta.name)
            if scheme is None:
                out.append(meta)
                continue
            for part in fp8_metas(meta.name, meta.shape, scheme):
                out.append(ParamMeta(part.name, part.dtype, part.shape, meta.owners))
        return out

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for group in self.iter_groups():
            yield from group

    def iter_groups(self) -> Iterator[list[tuple[str, Any]]]:
        """The inner source's layer groups, their FP8 weights quantized by one launch per
        batch of groups (consecutive groups until ``LAUNCH_BYTES`` of weights to quantize:
        a launch's host work, about half a millisecond, stays under its device time).

        One batch ahead: batch k+1 is read and its quantization launched before batch k's
        flags are read back, so the device quantizes while the round packs the batch before
        (one device read per batch, none per tensor). A batch's groups are yielded only once
        its flags say every weight is finite: a weight with NaN or inf never reaches the
        wire, and the round fails naming it before its commit."""
        spec = self._spec()
        self.last_stats.clear()  # in place: shared with the twins ``over`` made
        ahead: tuple[list[list[tuple[str, Any]]], LaunchedGroup | None] | None = None
        for batch in self._batches(spec):
            items = [(n, t, spec[n]) for group in batch for n, t in group if n in spec]
            launched = self._quantize(items, self.stats) if items else None
            if ahead is not None:
                yield from self._settled(*ahead, spec)
            ahead = (batch, launched)
        if ahead is not None:
            yield from self._settled(*ahead, spec)

    def _batches(self, spec: dict[str, Fp8Scheme]) -> Iterator[list[list[tuple[str, Any]]]]:
        """The inner source's groups, gathered until a batch holds ``LAUNCH_BYTES`` of
        weights to quantize (its last batch: what is left)."""
        sizes = {m.name: m.nbytes for m in self.inner.metadata() if m.name in spec}
        batch: list[list[tuple[str, Any]]] = []
        held = 0
        for group in self.inner.iter_groups():
            batch.append(group)
            held += sum(sizes.get(n, 0) for n, _ in group)
            if held >= LAUNCH_BYTES:
                yield batch
                batch, held = [], 0
        if batch:
            yield batch

    def _settled(
        self,
        batch: list[list[tuple[str, Any]]],
        launched: LaunchedGroup | None,
        spec: dict[str, Fp8Scheme],
    ) -> Iterator[list[tuple[str, Any]]]:
        if launched is None:
            yield from batch
            return
        errors = launched.settle()  # raises naming the non-finite weights, before any is sent
        quantized = iter(zip(launched.pairs, errors, strict=True))
        for group in batch:
            out: list[tuple[str, Any]] = []
            for name, tensor in group:
                scheme = spec.get(name)
                if scheme is None:
                    out.append((name, tensor))
                    continue
                (weight, scale), error = next(quantized)
                if error is not None:
                    self.last_stats[name] = error
                names = fp8_names(name, scheme)
                out += [(names.weight, weight), (names.scale, scale)]
            yield out

    def held_names(self) -> set[str] | None:
        held = self.inner.held_names()
        if held is None:
            return None
        out = set(held)
        if self.awaits_served:  # a TrainerGroup's init agrees on the inner source's names
            return out
        for name, scheme in self._spec().items():
            if name in held:
                out.update(fp8_names(name, scheme))
        return out

    def report(self) -> Fp8Report:
        """The last pass's FP8 part of a round (``RoundMetrics.fp8``)."""
        return Fp8Report(len(self._spec()), self.bytes_saved(), dict(self.last_stats))

    def bytes_saved(self) -> int:
        """Bytes per round the FP8 pairs save against the tensors they replace."""
        spec = self._spec()
        saved = 0
        for meta in self.inner.metadata():
            scheme = spec.get(meta.name)
            if scheme is None:
                continue
            before = wire_dtype(meta.dtype).itemsize * math.prod(meta.shape)
            after = sum(
                wire_dtype(p.dtype).itemsize * math.prod(p.shape)
                for p in fp8_metas(meta.name, meta.shape, scheme)
            )
            saved += before - after
        return saved
