"""Declarative pytree-leaf -> HF-name mapping, with per-rule layout transforms.

A ``Rule`` matches leaf paths (``params/model/layers_0/self_attn/q_proj/kernel``: keys
joined by ``/``) and names the HF tensor(s) the leaf becomes, with a chain of transforms
between the two. ``Naming.resolve(tree)`` turns rules plus a concrete pytree structure into
a ``Plan``: the ordered list of HF tensors, each built from one or more leaves. Everything
that can be wrong with a mapping (a leaf nobody claims, two leaves landing on one name, a
transform that does not fit the leaf's shape, a split that would drop data) is found here,
from shapes alone, so a bad mapping fails when the source is built rather than half way
through a broadcast that vLLM's workers are already waiting on.

The rules themselves, their pattern syntax and their checks, are ``jax_side.rules``.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Any

import jax

from weightwire.jax_side.rules import Rule
from weightwire.jax_side.transforms import (
    AddScalar,
    Cast,
    Concat,
    Entry,
    MergeAxes,
    NamingError,
    Op,
    Piece,
    Plan,
    Reshape,
    Slice,
    Split,
    Stacked,
    Transpose,
    chain,
    out_aval,
    out_avals,
    run_entry,
    show_paths,
)
from weightwire.shared.groups import layer_key


# --------------------------------------------------------------------- the plan
def path_str(keypath: Sequence[Any]) -> str:
    """``params/model/layers_0/...`` from a JAX key path (NNX's trailing ``.value`` dropped)."""
    parts = []
    for k in keypath:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    if keypath and type(keypath[-1]).__name__ == "GetAttrKey" and parts[-1] == "value":
        parts.pop()
    return "/".join(parts)


class Naming:
    """An ordered rule set. ``strip``: leading path components ignored when matching
    (presets strip ``params``, so both ``variables`` and ``variables['params']`` work)."""

    def __init__(self, rules: Sequence[Rule], *, strip: Sequence[str] = ()) -> None:
        self.rules = tuple(rules)
        if not self.rules:
            raise NamingError("a Naming needs at least one rule")
        for r in self.rules:
            if not isinstance(r, Rule):
                raise NamingError(f"{r!r} is not a Rule")
        self.strip = tuple(strip)

    def __repr__(self) -> str:
        return f"Naming({len(self.rules)} rules, strip={self.strip})"

    def _key(self, path: str) -> str:
        comps = path.split("/")
        while len(comps) > 1 and comps[0] in self.strip:
            comps = comps[1:]
        return "/".join(comps)

    def _match(self, path: str) -> tuple[int, re.Match[str]] | None:
        key = self._key(path)
        for i, rule in enumerate(self.rules):
            m = rule.regex.fullmatch(key)
            if m is not None:
                return i, m
        return None

    def resolve(self, tree: Any) -> Plan:
        """Resolve against ``tree`` (arrays or ``ShapeDtypeStruct``s; data never read)."""
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        if not flat:
            raise NamingError("the pytree has no leaves")
        paths = tuple(path_str(kp) for kp, _ in flat)
        avals = tuple(_aval(p, x) for p, (_, x) in zip(paths, flat, strict=True))
        unclaimed, dropped, used = [], [], [False] * len(self.rules)
        # name -> list of (piece, rule index, part, concat, cast, stack position)
        claims: dict[str, list[tuple[Piece, int, int, Concat | None, str | None, int]]] = {}
        for leaf, (path, aval) in enumerate(zip(paths, avals, strict=True)):
            hit = self._match(path)
            if hit is None:
                unclaimed.append(path)
                continue
            ri, m = hit
            rule = self.rules[ri]
            used[ri] = True
            if rule.target is None:
                dropped.append(path)
                continue
            axes, combos = _stack_indices(rule, m, path, aval)
            _check_split(rule, path, aval)
            chains, concat, cast = rule.op_chains(), rule.concat, rule.cast
            for seq, (indices, fields) in enumerate(combos):
                for part, (tpl, ops) in enumerate(zip(rule.templates, chains, strict=True)):
                    piece = Piece(leaf, path, indices, axes, ops)
                    claims.setdefault(tpl.format(**fields), []).append(
                        (piece, ri, part, concat, cast, seq)
                    )
        if unclaimed:
            raise NamingError(
                "no naming rule claims these pytree leaves: "
                f"{show_paths(unclaimed)}; add a rule for each, or a drop rule "
                "(target None) for leaves the server does not take"
            )
        # A rule shadowed by an earlier one (an override) is not a typo; one that fits no path is.
        missing = [
            r.pattern
            for r, u in zip(self.rules, used, strict=True)
            if not u and not r.optional and not any(r.regex.fullmatch(self._key(p)) for p in paths)
        ]
        if missing:
            raise NamingError(
                f"naming rules matched no pytree leaf: {show_paths(missing)}; leaves look like "
                f"{show_paths(paths, 4)}"
            )
        entries = [self._entry(name, got) for name, got in claims.items()]
        order = _order_keys(entries, claims, len(self.rules))
        entries = [e for _, e in sorted(zip(order, entries, strict=True), key=lambda t: t[0])]
        plan = Plan(treedef, paths, avals, tuple(entries), tuple(dropped))
        out_avals(plan, None)  # a transform that does not fit its leaf fails here
        return plan

    @staticmethod
    def _entry(
        name: str, got: list[tuple[Piece, int, int, Concat | None, str | None, int]]
    ) -> Entry:
        if len(got) == 1 and got[0][3] is None:
            piece, _, _, _, cast, _ = got[0]
            return Entry(name, (piece,), None, cast)
        fused = [(g[3], g) for g in got if g[3] is not None]
        concats = [c for c, _ in fused]
        if len(fused) != len(got):
            raise NamingError(
                f"pytree leaves {show_paths([g[0].path for g in got])} all map to "
                f"HF name {name!r}; each HF name must come from exactly one leaf "
                "(or be declared a Concat)"
            )
        count, axis = concats[0].count, concats[0].axis
        indices = sorted(c.index for c in concats)
        if indices != list(range(count)) or any(
            c.count != count or c.axis != axis for c in concats
        ):
            raise NamingError(
                f"HF name {name!r} fuses {count} parts along axis {axis}, but got part indices "
                f"{indices} from {show_paths([g[0].path for g in got])}"
            )
        casts = {g[4] for g in got}
        if len(casts) != 1:
            raise NamingError(
                f"parts of fused HF name {name!r} pin different dtypes: {sorted(map(str, casts))}"
            )
        ordered = [g for _, g in sorted(fused, key=lambda cg: cg[0].index)]
        return Entry(name, tuple(g[0] for g in ordered), axis, casts.pop())


def _aval(path: str, x: Any) -> jax.ShapeDtypeStruct:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise NamingError(f"pytree leaf {path!r} is a {type(x).__name__}, not an array")
    return jax.ShapeDtypeStruct(tuple(int(d) for d in x.shape), x.dtype)


def _stack_axes(rule: Rule, path: str, aval: jax.ShapeDtypeStruct) -> list[tuple[int, Stacked]]:
    """The rule's stacked axes of this leaf, normalised, highest axis first."""
    rank = len(aval.shape)
    out = []
    for st in rule.stacks:
        if not -rank <= st.axis < rank:
            raise NamingError(
                f"pytree leaf {path!r} has shape {list(aval.shape)}: no {st.field} axis {st.axis} "
                f"(rule {rule.pattern!r} says it is stacked)"
            )
        out.append((st.axis % rank, st))
    if len({a for a, _ in out}) != len(out):
        raise NamingError(f"rule {rule.pattern!r} stacks pytree leaf {path!r} twice along one axis")
    return sorted(out, key=lambda t: -t[0])


def _stack_indices(
    rule: Rule, m: re.Match[str], path: str, aval: jax.ShapeDtypeStruct
) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], dict]]]:
    """``(stack axes, [(indices, template fields), ...])``: one combination per HF tensor,
    ordered by the rules' own Stacked order (layer-major for
    ``Stacked(0), Stacked(1, field="expert")``)."""
    fields = m.groupdict()
    stacked = _stack_axes(rule, path, aval)
    if not stacked:
        return (), [((), fields)]
    axes = tuple(a for a, _ in stacked)
    # Iterate in declaration order (outer loop = first Stacked), store indices highest axis first.
    declared = sorted(range(len(stacked)), key=lambda k: rule.stacks.index(stacked[k][1]))
    combos = []
    for combo in itertools.product(*(range(aval.shape[stacked[k][0]]) for k in declared)):
        idx = [0] * len(stacked)
        f = dict(fields)
        for k, i in zip(declared, combo, strict=True):
            idx[k] = i
            f[stacked[k][1].field] = i + stacked[k][1].offset
        combos.append((tuple(idx), f))
    return axes, combos


def _order_keys(
    entries: list[Entry], claims: dict[str, list[Any]], n_rules: int
) -> list[tuple[Any, ...]]:
    """HF order with each layer contiguous: un-layered tensors whose rule precedes every
    layered rule, then layers (per layer prefix, by index, then rule order), then the rest.
    Within one rule and leaf, stacked tensors keep their index order (expert 2 before 10)."""
    info = []
    for e in entries:
        got = claims[e.name]
        if len(got) == 1:
            _, rule, part, _, _, seq = got[0]
            leaf = e.pieces[0].leaf
        else:
            rule, part = min(g[1] for g in got), min(g[2] for g in got)
            seq, leaf = min(g[5] for g in got), min(p.leaf for p in e.pieces)
        info.append((e, rule, (part, seq), leaf, layer_key(e.name)))
    layered_rules = [rule for _, rule, _, _, key in info if key is not None]
    first_layered = min(layered_rules, default=n_rules)
    prefix_rank: dict[str, tuple[int, int]] = {}
    for _, rule, _, _, key in sorted(info, key=lambda t: (t[1], t[3])):
        if key is not None:
            prefix_rank.setdefault(_split_key(key)[0], (rule, len(prefix_rank)))
    keys = []
    for e, rule, part, leaf, key in info:
        if key is None:
            keys.append((0 if rule < first_layered else 2, (0, 0), 0, rule, part, leaf, e.name))
        else:
            prefix, index = _split_key(key)
            keys.append((1, prefix_rank[prefix], index, rule, part, leaf, e.name))
    return keys


def _split_key(key: str) -> tuple[str, int]:
    """``model.layers.3`` -> (``model.layers``, 3); a bare ``3`` -> ("", 3)."""
    head, _, index = key.rpartition(".")
    return head, int(index)


def _check_split(rule: Rule, path: str, aval: jax.ShapeDtypeStruct) -> None:
    """A Split must consume its whole axis: a remainder would be silently dropped."""
    split = rule.split
    if split is None:
        return
    shape = aval.shape
    for ax, _ in _stack_axes(rule, path, aval):  # highest first: earlier removals shift nothing
        shape = shape[:ax] + shape[ax + 1 :]
    pre_ops = [p for p in rule.parts[: rule.parts.index(split)] if isinstance(p, Op)]
    try:
        pre = jax.eval_shape(lambda x: chain(pre_ops, x), jax.ShapeDtypeStruct(shape, aval.dtype))
        dim = pre.shape[split.axis]
    except Exception as exc:
        raise NamingError(
            f"transform of pytree leaf {path!r} (shape {list(aval.shape)}) before its Split "
            f"fails: {exc}"
        ) from exc
    if sum(split.sizes) != dim:
        raise NamingError(
            f"Split sizes {list(split.sizes)} of pytree leaf {path!r} add up to "
            f"{sum(split.sizes)}, but axis {split.axis} has {dim}; a remainder "
            "would be silently dropped"
        )


__all__ = [
    "AddScalar",
    "Cast",
    "Concat",
    "Entry",
    "MergeAxes",
    "Naming",
    "NamingError",
    "Op",
    "Piece",
    "Plan",
    "Reshape",
    "Slice",
    "Split",
    "Stacked",
    "Transpose",
    "out_aval",
    "path_str",
    "run_entry",
]
