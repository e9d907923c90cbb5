"""What vLLM's own ``sparse_nccl`` receiver takes, and a delta round planned for it.

Read from vLLM's ``sparse_nccl_engine.py`` and ``checkpoint_weight_patch.py`` (the receive
and apply code is the same in 0.30, 0.31, 0.32 and 0.33):

- init info: the dense ``nccl`` worker's (unique-id rendezvous, ``rank_offset`` 1, the
  same one-element warm-up ``all_reduce``); the packed fields are parsed and unused.
- update info: ``names`` / ``dtype_names`` / ``shapes`` (checkpoint names, full shapes)
  and ``num_updates_list`` (one count per name, ``>= 0``; the list may not be empty).
- wire: per name, in order, from rank 0: one broadcast of ``num_updates`` ``int32`` flat
  indices, then one of ``num_updates`` values of the name's dtype; each with its own NCCL
  type, never packed. That is exactly our unpacked wire of ``T@index``, ``T@values``.
- apply: after the last broadcast, every patch is checked (no NaN among the values, every
  index in range, no index twice) before anything is written; then each patch becomes a
  full checkpoint-shaped tensor of NaN with the values scattered in, and goes through the
  model's ``load_weights`` with ``Tensor.copy_`` replaced by "keep the destination where the
  source is NaN". So a dtype without NaN (integers, bool) cannot be patched, the loader must
  end in a same-shaped floating ``copy_``, and the worker stages one full tensor per patch
  (up to 512 MiB of them per loader call). Not transactional: a loader that fails after
  earlier calls leaves those applied. ``start`` / ``finish`` do nothing (no layerwise
  reload, no draft model).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from weightwire.backends.base import PatchPlan, StockRefusal
from weightwire.shared.framing import plan_unpacked
from weightwire.shared.patches import SparsePatch, check_patches, wire_metas, wire_pairs
from weightwire.shared.source import Describe
from weightwire.shared.version import ServerFeatures

SPARSE_DTYPES = ("bfloat16", "float16", "float32", "float64")
"""Floating dtypes with a NaN (the receiver's "unchanged" mark) and an NCCL type in vLLM's
wrapper: the only ones a ``sparse_nccl`` patch can carry."""

BACKEND = "sparse_nccl"


@dataclass(frozen=True)
class SparseNCCLUpdateInfo:
    """One round's update info, as vLLM's ``sparse_nccl`` worker parses it."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    num_updates_list: list[int]

    def to_dict(self) -> dict[str, list]:
        return asdict(self)


def refuse_dtype(name: str, dtype: str, version: str) -> None:
    """``StockRefusal`` unless ``dtype`` is one a ``sparse_nccl`` patch can carry."""
    if dtype not in SPARSE_DTYPES:
        raise StockRefusal(
            name,
            f"dtype {dtype} cannot be patched: vLLM's sparse loader marks unchanged elements "
            f"with NaN, so only {', '.join(SPARSE_DTYPES)} tensors are accepted",
            version,
            backend=BACKEND,
        )


def sparse_nccl_round(
    patches: Sequence[SparsePatch], *, features: ServerFeatures, describe: Describe
) -> PatchPlan:
    """The delta round of ``patches`` for a stock ``sparse_nccl`` worker.

    ``patches``: ``shared.patches.SparsePatch`` records, one per changed tensor (checkpoint name,
    wire dtype, full shape, 1-D ``int32`` flat indices, 1-D values of the tensor's dtype).
    Returns the update info to post (``PatchPlan.update_info``), the wire tensors in
    broadcast order (per patch: indices, then values) and their unpacked chunks (one
    broadcast each, with its own NCCL type). Raises before any byte: ``ConfigError`` for a
    malformed patch, ``StockRefusal`` for a dtype the receiver cannot apply,
    ``ValueError`` for a server without ``sparse_nccl``, an empty round (vLLM refuses an
    empty ``num_updates_list``: a round with nothing changed is not sent).
    """
    features.require("sparse_nccl", "the server's sparse_nccl receiver takes the patches")
    if not patches:
        raise ValueError(
            "a sparse_nccl round needs at least one patch: vLLM refuses an empty update info"
        )
    checked = check_patches(patches, describe)
    for c in checked:
        refuse_dtype(c.patch.name, c.patch.dtype, features.version)
    info = SparseNCCLUpdateInfo(
        names=[c.patch.name for c in checked],
        dtype_names=[c.patch.dtype for c in checked],
        shapes=[list(c.patch.shape) for c in checked],
        num_updates_list=[c.nnz for c in checked],
    )
    metas = wire_metas(checked)
    return PatchPlan(
        update_info=info.to_dict(),
        metas=metas,
        chunks=plan_unpacked(metas),
        pairs=lambda: wire_pairs(checked),
        full=frozenset(c.patch.name for c in checked if c.full),
    )
