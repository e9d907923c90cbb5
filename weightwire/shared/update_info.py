"""``UpdateInfo``: the JSON body of ``/update_weights`` (one round's tensors in broadcast order,
and a delta round's patches), parsed strictly on both sides like every info
(``shared.info.StrictInfo``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from weightwire.shared.delta import Patch, PatchEntry, PatchRows, check_patches, check_token
from weightwire.shared.dtypes import wire_dtype
from weightwire.shared.errors import ConfigError
from weightwire.shared.info import StrictInfo
from weightwire.shared.limits import LIMITS
from weightwire.shared.meta import MetaRows, ParamMeta, validate_shape

__all__ = ["UpdateInfo"]


@dataclass(frozen=True, kw_only=True, repr=False)
class UpdateInfo(StrictInfo):
    """Per-round metadata: three equal-length lists in broadcast order.

    All three empty means "reuse the previous round's metadata" on servers >= 0.33
    (see ``version.ServerFeatures.reuse_metadata``); on older ones, zero tensors.
    ``src`` is the transfer-group rank that broadcasts this turn (several broadcasting
    trainer ranks); it is omitted from the body when 0, so single-broadcaster payloads
    stay exactly what a stock vLLM (which only takes ``src=0``) reads.

    Weightwire trainers also send ``round_token`` (the same in every update POST of a
    round); a delta round adds ``delta_base`` (the token of the round its patches were
    built on: a worker holding another round refuses it with ``DeltaBaseMismatch``) and
    ``patches`` (``shared.delta``: one ``[name, dtype_name, shape, nnz, "flat_i32"]`` per
    patched tensor, whose ``@index`` / ``@values`` wire tensors ``names`` lists). Unset,
    all three are left out of the body.
    """

    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[Sequence[int]] = field(default_factory=list)
    """Lists (JSON) or tuples (a trainer's own metas' shapes, written the same)."""
    src: int = 0
    round_token: str | None = None
    delta_base: str | None = None
    patches: list[Sequence[Any]] | None = None
    sliced: bool = False
    """The round is sliced (a backend with sliced rounds): each worker receives only the
    boxes of each tensor it wants, as framed pieces on its own link, instead of the
    broadcast chunks. Left out of the body when False."""
    shares: list[list[int]] | None = None
    """A sliced delta round (``sliced`` with ``patches``): per worker (in the trainer's worker
    order: a worker's session rank - 1), per patch (``patches``' order), how many of that
    patch's elements the worker receives: those whose checkpoint coordinates fall in the
    boxes it wants. Its ``@index`` / ``@values`` wire tensors then reach it as ``[share]``
    (flat indices into the whole checkpoint tensor, increasing), not ``[nnz]``; a worker
    checks it got exactly its share. Left out of the body when None."""

    _patch_entries: ClassVar[tuple[PatchEntry, ...]] = ()
    """The patches as ``__post_init__`` checked them, as entries (tuples of atoms: no record
    per patch held through the round, #49; set per instance; not a field, so never in the
    body)."""

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if not self.src:
            del out["src"]
        if not self.patches:
            out.pop("patches", None)
        if not self.sliced:
            del out["sliced"]
        return out

    def __post_init__(self) -> None:
        if not 0 <= self.src < LIMITS.max_world_size:
            raise ConfigError(
                f"src must be a group rank in [0, {LIMITS.max_world_size}), got {self.src}"
            )
        n = len(self.names)
        if n > LIMITS.max_tensors:
            raise ConfigError(f"names lists {n} tensors, over the limit {LIMITS.max_tensors}")
        for key in ("dtype_names", "shapes"):
            if len(getattr(self, key)) != n:
                raise ConfigError(f"{key} has {len(getattr(self, key))} entries but names has {n}")
        total = 0
        for i, (name, dtype, shape) in enumerate(
            zip(self.names, self.dtype_names, self.shapes, strict=True)
        ):
            if not isinstance(name, str) or not name or len(name) > LIMITS.max_name_length:
                raise ConfigError(
                    f"names[{i}] must be a non-empty string of <= {LIMITS.max_name_length} chars"
                )
            try:
                row = wire_dtype(dtype)
            except ValueError as exc:
                raise ConfigError(f"dtype_names[{i}]: {exc}") from None
            dims = validate_shape(shape, field=f"shapes[{i}]")
            nbytes = math.prod(dims) * row.itemsize
            if nbytes > LIMITS.max_tensor_bytes:
                raise ConfigError(
                    f"shapes[{i}] {list(dims)} is {nbytes} bytes, "
                    f"over the per-tensor limit {LIMITS.max_tensor_bytes}"
                )
            total += nbytes
        if total > LIMITS.max_round_bytes:
            raise ConfigError(
                f"shapes total {total} bytes, over the per-round limit {LIMITS.max_round_bytes}"
            )
        if len(set(self.names)) != n:
            seen: set[str] = set()
            dup = next(x for x in self.names if x in seen or seen.add(x))  # type: ignore[func-returns-value]
            raise ConfigError(f"names lists {dup!r} more than once")
        if type(self.sliced) is not bool:
            raise ConfigError(f"sliced must be a bool, got {self.sliced!r}")
        check_token("round_token", self.round_token)
        check_token("delta_base", self.delta_base)
        patches = check_patches(
            self.names,
            self.dtype_names,
            self.shapes,
            self.patches or [],
            delta_base=self.delta_base,
            round_token=self.round_token,
        )
        # Checked once here (a delta round's hundreds of entries cost the worker milliseconds
        # per pass, on the round's critical path); the fields are frozen, so it stays true.
        # from a list (sized): a tuple grown from a generator is resized as it fills, which
        # fails if anything (bench_gc_rounds --show's walks) holds it meanwhile
        object.__setattr__(self, "_patch_entries", tuple([p.to_entry() for p in patches]))
        if self.shares is not None:
            _check_shares(self.shares, patches, sliced=self.sliced)

    def patch_list(self) -> PatchRows:
        """The round's patches, checked against its wire listing (``shared.delta``) when the
        info was made; each ``Patch`` made as it is read."""
        return PatchRows(self._patch_entries)

    @property
    def reuses_previous(self) -> bool:
        return not self.names

    def metas(self) -> list[ParamMeta]:
        return [
            ParamMeta(n, d, tuple(s))
            for n, d, s in zip(self.names, self.dtype_names, self.shapes, strict=True)
        ]

    def meta_rows(self) -> MetaRows:
        """``metas()`` as rows over this info's own lists: no object per tensor (a delta
        round's listing, new each round, #49)."""
        return MetaRows(self.names, self.dtype_names, self.shapes)

    @classmethod
    def from_metas(cls, metas: list[ParamMeta]) -> UpdateInfo:
        return cls(
            names=[m.name for m in metas],
            dtype_names=[m.dtype for m in metas],
            shapes=[list(m.shape) for m in metas],
        )

    def share(self, worker: int) -> list[int]:
        """Worker ``worker``'s elements of each patch (``shares``); ``ConfigError`` when the
        round names no share for it (a trainer that counted fewer workers)."""
        if self.shares is None:
            raise ConfigError("the update has no shares (it is not a sliced delta round)")
        if not 0 <= worker < len(self.shares):
            raise ConfigError(
                f"shares name {len(self.shares)} worker(s), none for worker {worker}: the "
                "trainer planned for another set of workers"
            )
        return self.shares[worker]

    def __repr__(self) -> str:
        src = f", src={self.src}" if self.src else ""
        delta = f", {len(self.patches)} patches" if self.patches else ""
        return f"UpdateInfo({len(self.names)} tensors{src}{delta})"


def _check_shares(shares: Any, patches: list[Patch], *, sliced: bool) -> None:
    """``shares``: a sliced delta round's, one row per worker, one count in ``[0, nnz]`` per
    patch."""
    if not sliced or not patches:
        raise ConfigError("shares are a sliced delta round's: they need sliced and patches")
    if not isinstance(shares, list) or not 0 < len(shares) <= LIMITS.max_world_size:
        raise ConfigError(
            f"shares must be a list of 1 to {LIMITS.max_world_size} per-worker rows, "
            f"got {type(shares).__name__}"
        )
    for w, row in enumerate(shares):
        ok = isinstance(row, list) and len(row) == len(patches)
        ok = ok and all(
            type(n) is int and 0 <= n <= p.nnz for n, p in zip(row, patches, strict=True)
        )
        if not ok:
            raise ConfigError(
                f"shares[{w}] must list, per patch, an int count in [0, its nnz] "
                f"({len(patches)} patches)"
            )
