"""``PytreeSource``: the ``WeightSource`` a JAX trainer hands to the engine.

Where the bytes come from: the leaves of the params pytree, transformed on device by
jitted functions compiled once per (transform chain, shapes, dtype) and reused for every
layer, then placed whole on one target device. No host round trip anywhere: a sharded
leaf (several local devices) is transformed where it lives and the result moved with a
device-to-device ``jax.device_put`` to the target; ``metadata()`` is abstract evaluation
only. Nothing is donated.

Lifetime of handed-out arrays: each is an ordinary ``jax.Array`` the consumer may keep
as long as it likes; the source additionally keeps a reference to the item (or, for
``iter_groups``, the group) it yielded last, until the next one or the end of the pass,
so a consumer holding only a raw device pointer (DLPack, NCCL) is safe until it asks for
more. When an output is exactly a leaf (no transform, same dtype, already on the target),
the leaf itself is handed out: it stays valid until the trainer donates it. A trainer
that overlaps rounds with its next step (``send_weights(wait=False)``, which sends a
``frozen()`` twin) must not donate the params to that step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from weightwire.jax_side.dtypes import describe, jax_dtype, wire_name
from weightwire.jax_side.naming import Entry, Naming, Plan, out_aval, run_entry
from weightwire.jax_side.placement import Target, device_ids, replicated
from weightwire.jax_side.transforms import out_avals
from weightwire.jax_side.trees import kind_of, params_tree
from weightwire.shared.errors import ConfigError, WrongType
from weightwire.shared.groups import layerwise_groups
from weightwire.shared.meta import ParamMeta
from weightwire.shared.source import WeightSource, checked_iter

Signature = tuple[tuple[Any, Any, tuple[int, ...]], ...]
"""Per output: (entry structure, output dtype, positions of its pieces' leaves in the
call's deduplicated input list)."""
_COMPILED: dict[Signature, Callable[..., tuple[jax.Array, ...]]] = {}


def _compiled(signature: Signature) -> Callable[..., tuple[jax.Array, ...]]:
    """One jitted function per group signature; ``jax.jit`` then caches per input shape,
    so a model's N identical layers compile once. Each distinct leaf is one argument
    however many outputs read it (a stacked expert kernel feeds 128 of them)."""
    fn = _COMPILED.get(signature)
    if fn is None:

        def run(inputs: Sequence[jax.Array], idx: jax.Array | None) -> tuple[jax.Array, ...]:
            outs, k = [], 0
            for structure, dtype, slots in signature:
                xs = [inputs[s] for s in slots]
                idxs = []
                for stack_axes, _ in structure[0]:
                    picked: tuple[jax.Array, ...] = ()
                    if stack_axes:
                        assert (
                            idx is not None
                        )  # a group with stacked leaves is called with their indices
                        picked = tuple(idx[k + j] for j in range(len(stack_axes)))
                    idxs.append(picked)
                    k += len(stack_axes)
                outs.append(run_entry(structure, xs, idxs, dtype))
            return tuple(outs)

        fn = _COMPILED[signature] = jax.jit(run)
    return fn


def _refuse_deleted(get: Callable[[], Any], leaves: Sequence[Any]) -> None:
    """``ConfigError`` naming the first leaf whose buffer was deleted (donated to a jitted
    step), before any round reads it: JAX's own error would come mid-round, bare. About
    0.6 us a leaf; ``get`` (the params) is flattened again only to name one."""
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            tree = params_tree(get())
            path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(tree)[0][i][0])
            raise ConfigError(
                f"the params' leaf {path} was deleted (donated to a jitted step, "
                "donate_argnums?): a round reads the arrays the source's getter returns; "
                "return the step's new params from the getter, or do not donate them"
            )


class PytreeSource(WeightSource):
    """``PytreeSource(params, naming, *, dtype=None, device=None)``.

    ``params``: a pytree of arrays, a Flax NNX ``Module`` / ``nnx.State`` or an Equinox
    ``Module`` (``trees.params_tree``: their parameter arrays), or a zero-argument
    callable returning any of these (a training loop's live state; called once per
    ``metadata()`` and once per pass, and once here so that mapping errors surface now).
    An NNX module is updated in place by its optimizer, so passing it is already live;
    an Equinox model is replaced each step, so pass ``lambda: state.model``. ``dtype``: wire dtype
    for float leaves (``"bfloat16"``, ``jnp.bfloat16``, ...); ``None`` keeps each leaf's.
    ``device``: where yielded arrays live (default: the first local device).
    """

    def __init__(
        self,
        params: Any,
        naming: Naming,
        *,
        dtype: Any = None,
        device: jax.Device | int | None = None,
    ) -> None:
        if not isinstance(naming, Naming):
            raise WrongType(f"naming must be a weightwire Naming, got {type(naming).__name__}")
        self._get: Callable[[], Any] = params if _is_callable_source(params) else (lambda: params)
        self._naming = naming
        self._dtype = None if dtype is None else wire_name(jax_dtype(dtype))
        devices = jax.local_devices()
        if device is None:
            device = devices[0]
        elif isinstance(device, int):
            if not 0 <= device < len(devices):
                raise ConfigError(
                    f"device index {device} out of range: {len(devices)} local devices"
                )
            device = devices[device]
        self._place = Target(device)
        self._placing = True
        """Outputs go whole to the target device (``sharded``: they stay where XLA put them)."""
        self._plan: Plan | None = None
        self._metas: list[ParamMeta] = []
        self._batches: dict[
            tuple[int, ...], _Batch
        ] = {}  # per plan: static half of each batch's call
        self._groups: list[list[Entry]] | None = None  # per plan: the full pass's layer groups
        self._todo: list[tuple[Entry, ParamMeta]] | None = (
            None  # per plan: the full pass's (entry, meta) pairs
        )
        self._declared: list[ParamMeta] | None = None
        self._declared_whole = (
            False  # metadata() found every leaf addressable (see checks_own_stream)
        )
        self._current()

    def __repr__(self) -> str:
        return (
            f"PytreeSource({len(self._metas)} tensors, dtype={self._dtype or 'as-is'}, "
            f"device={self._place.device})"
        )

    @property
    def device(self) -> jax.Device:
        return self._place.device

    def frozen(self) -> PytreeSource:
        """This source bound to the params as they are now (what an overlapped round sends).

        The arrays are referenced, not copied: a ``jax.Array`` never changes, so the trainer
        may compute its next step while a round reads these. A numpy leaf (mutable) is
        copied. Refused (``ConfigError``) for a leaf already deleted (donated to a step) or
        one this process cannot address whole (a multi-process trainer's passes take part in
        collectives, which must stay on the trainer's thread)."""
        leaves, treedef = jax.tree_util.tree_flatten(params_tree(self._get()))
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, jax.Array):
                if leaf.is_deleted():
                    raise ConfigError(
                        f"leaf {i} of the params was deleted (donated to a jitted step?): an "
                        "overlapped round reads the arrays of the step it was called after; "
                        "do not donate the params"
                    )
                if not leaf.is_fully_addressable:
                    raise ConfigError(
                        f"leaf {i} spans several processes: send_weights(wait=False) needs "
                        "every leaf addressable from this process"
                    )
            elif isinstance(leaf, np.ndarray):
                leaves[i] = leaf.copy()
        tree = jax.tree_util.tree_unflatten(treedef, leaves)
        twin = copy.copy(self)
        twin._get = lambda: tree
        return twin

    def sharded(self) -> PytreeSource:
        """This source with its outputs left where they are computed (a sharded leaf's
        transform stays sharded) instead of moved whole to the target device: what a sliced
        round reads, each piece from the shard that holds it (``jax_side.holdings``). Leaves
        spread over several device sets that one transform takes together are still
        gathered (rare layouts)."""
        twin = copy.copy(self)
        twin._placing = False
        return twin

    # -- the plan for the params as they are now
    def _current(self) -> tuple[Plan, list[Any]]:
        tree = params_tree(self._get())
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if self._plan is None or not self._plan.matches(treedef, leaves):
            plan = self._naming.resolve(tree)
            metas = []
            for e, aval in zip(plan.entries, out_avals(plan, self._dtype), strict=True):
                try:
                    metas.append(ParamMeta(e.name, wire_name(aval.dtype), aval.shape))
                except ValueError as exc:
                    raise ConfigError(
                        f"HF tensor {e.name!r} from {[p.path for p in e.pieces]}: {exc}"
                    ) from exc
            layerwise_groups(
                metas
            )  # a preset that interleaves layers fails here, not on the worker
            self._plan, self._metas, self._batches, self._groups, self._todo = (
                plan,
                metas,
                {},
                None,
                None,
            )
        return self._plan, leaves

    # -- WeightSource
    def metadata(self) -> list[ParamMeta]:
        """Names, wire dtypes and shapes in HF order; shapes only, no device work or transfer.

        The answer is remembered: later passes are checked against it, so params that
        changed shape or dtype after a round's metadata went out fail before sending.
        """
        plan, leaves = self._current()
        # once per round (the engine reads the metadata first): before anything is sent
        _refuse_deleted(self._get, leaves)
        self._declared = list(self._metas)
        self._declared_whole = _held(plan, leaves) is None
        return list(self._metas)

    def checks_own_stream(self, metas: Sequence[ParamMeta]) -> bool:
        """``True`` for the metadata this source last declared while it held every tensor:
        each pass is ``checked_iter``-ed against exactly that list."""
        return self._declared_whole and self._declared == list(metas)

    def held_names(self) -> set[str] | None:
        """``None`` when every leaf is fully addressable from this process (always, single
        host); otherwise the names whose leaves are."""
        return _held(*self._current())

    def __iter__(self) -> Iterator[tuple[str, jax.Array]]:
        """A fresh pass: ``(hf_name, jax.Array on the target device)`` in metadata order,
        checked against ``metadata()`` (``SourceMismatch`` names the first divergence)."""
        plan, leaves, todo, declared = self._pass()
        return checked_iter(self._produce(plan, leaves, [[e] for e, _ in todo]), declared, describe)

    def iter_groups(self) -> Iterator[list[tuple[str, jax.Array]]]:
        """The same stream one layer group at a time, each group built by one jitted call."""
        plan, leaves, todo, declared = self._pass()
        if len(todo) == len(plan.entries) and self._groups is not None:
            batches = self._groups
        else:
            by_name = dict((m.name, e) for e, m in todo)
            batches = [[by_name[m.name] for m in g] for g in layerwise_groups([m for _, m in todo])]
            if len(todo) == len(plan.entries):
                self._groups = batches
        pairs = checked_iter(self._produce(plan, leaves, batches), declared, describe)
        for batch in batches:
            group = [next(pairs) for _ in batch]
            yield group
        for _ in pairs:  # drains the checker: raises if the stream had extra or missing tensors
            pass

    # -- production
    def _pass(self) -> tuple[Plan, list[Any], list[tuple[Entry, ParamMeta]], list[ParamMeta]]:
        """This pass's (entry, meta) pairs, and the metadata to check them against: what
        ``metadata()`` last declared (the receiver sized its buffers from that), else the
        current plan's."""
        plan, leaves = self._current()
        # left sharded (``sharded``), every process runs every transform on its shards: each
        # pass yields every tensor, whatever this process addresses of it
        held = _held(plan, leaves) if self._placing else None
        declared = self._metas if self._declared is None else self._declared
        if held is None:  # every tensor (one process, always): the pairs are the plan's, made once
            if self._todo is None:
                self._todo = list(zip(plan.entries, self._metas, strict=True))
            return plan, leaves, self._todo, declared
        todo = [(e, m) for e, m in zip(plan.entries, self._metas, strict=True) if e.name in held]
        return plan, leaves, todo, [m for m in declared if m.name in held]

    def _produce(
        self, plan: Plan, leaves: list[Any], batches: list[list[Entry]]
    ) -> Iterator[tuple[str, jax.Array]]:
        for batch in batches:
            arrays = self._run(plan, leaves, batch)
            for entry, array in zip(batch, arrays, strict=True):
                yield entry.name, array
            # `arrays` (the reference the module docstring promises) lives until the next batch

    def _batch(self, plan: Plan, batch: list[Entry]) -> _Batch:
        """What is static about one batch's call, built once per plan: the per-tensor
        Python work (dtypes, signature hashing, layer indices) is paid on the first
        pass only, so later rounds cost one dispatch per group, not per tensor."""
        key = tuple(id(e) for e in batch)
        hit = self._batches.get(key)
        if hit is not None:
            return hit
        dtypes = [out_aval(plan, e, self._dtype).dtype for e in batch]
        same = [
            e.is_identity and plan.avals[e.pieces[0].leaf].dtype == d
            for e, d in zip(batch, dtypes, strict=True)
        ]
        jitted = [k for k, s in enumerate(same) if not s]
        slot: dict[int, int] = {}
        for k in jitted:
            for p in batch[k].pieces:
                slot.setdefault(p.leaf, len(slot))
        signature = tuple(
            (batch[k].structure, np.dtype(dtypes[k]), tuple(slot[p.leaf] for p in batch[k].pieces))
            for k in jitted
        )
        layers = [i for k in jitted for p in batch[k].pieces for i in p.indices]
        hit = _Batch(
            [k for k, s in enumerate(same) if s],
            jitted,
            list(slot),
            _compiled(signature) if jitted else None,
            np.asarray(layers, np.int32) if layers else None,
        )
        self._batches[key] = hit
        return hit

    def _run(self, plan: Plan, leaves: list[Any], batch: list[Entry]) -> list[jax.Array]:
        b = self._batch(plan, batch)
        outs: list[jax.Array | None] = [None] * len(batch)
        for k in b.direct:
            leaf = leaves[batch[k].pieces[0].leaf]
            # Handed out as is when already on the target; else one device-to-device copy.
            if not self._placing and isinstance(leaf, jax.Array):
                outs[k] = leaf
            else:
                outs[k] = (
                    leaf if self._place.holds(leaf) else self._place.move(self._place.upload(leaf))
                )
        if b.jitted:
            inputs = [self._place.upload(leaves[i]) for i in b.leaves]
            first = inputs[
                0
            ].sharding  # equal shardings share a device set (the usual case: one device)
            if (
                any(x.sharding != first for x in inputs)
                and len({device_ids(x) for x in inputs}) > 1
            ):
                # One jit needs one device set; inputs spread over several are gathered on the
                # target first (device to device). Whole stacked leaves move here: rare layouts
                # only.
                inputs = [self._place.move(x) for x in inputs]
            idx = b.idx
            if idx is not None:
                # Placed once per sharding, not uploaded again every round (the indices are static).
                sharding = inputs[0].sharding
                placed = b.placed.get(sharding)
                if placed is None:
                    where = replicated(sharding)
                    placed = idx if where is None else jax.device_put(idx, where)
                    if len(b.placed) < 8:  # a few shardings per batch at most, in practice one
                        b.placed[sharding] = placed
                idx = placed
            assert b.fn is not None
            results = list(b.fn(inputs, idx))
            for k, r in zip(b.jitted, results, strict=True):
                outs[k] = r if not self._placing or self._place.holds(r) else self._place.move(r)
        return outs  # type: ignore[return-value]


@dataclass(frozen=True)
class _Batch:
    direct: list[int]  # batch positions handed out from a leaf as is (or copied to the target)
    jitted: list[int]  # batch positions built by ``fn``, in its output order
    leaves: list[int]  # the distinct leaves ``fn`` takes, in argument order
    fn: Callable[..., tuple[jax.Array, ...]] | None
    idx: np.ndarray | None  # every stacked piece's indices, flattened in signature order
    placed: dict[Any, Any] = field(default_factory=dict)  # sharding -> ``idx`` on its devices


def _is_callable_source(params: Any) -> bool:
    # NNX and Equinox modules are callable (their forward pass) but are trees, not getters.
    return (
        callable(params)
        and not isinstance(params, (dict, list, tuple))
        and not hasattr(params, "shape")
        and kind_of(params) == "pytree"
    )


def _held(plan: Plan, leaves: list[Any]) -> set[str] | None:
    # One process sees every device: nothing to ask per leaf (twice per round, 290 leaves).
    if jax.process_count() == 1 or all(_addressable(x) for x in leaves):
        return None
    return {e.name for e in plan.entries if all(_addressable(leaves[p.leaf]) for p in e.pieces)}


def _addressable(x: Any) -> bool:
    return not isinstance(x, jax.Array) or x.is_fully_addressable
