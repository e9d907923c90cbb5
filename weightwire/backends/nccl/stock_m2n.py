"""Driving vLLM 0.33's own ``nccl_m2n`` receiver from a torch-free trainer.

What the stock worker (``vllm/distributed/weight_transfer/m2n_engine.py``,
``M2NWeightTransferEngine``) takes, and what this module sends it, step by step:

1. **Init info** (``M2NWeightTransferInitInfo``): ``schema_version`` 2, ``master_address`` /
   ``master_port`` (the metadata rendezvous, required even with a unique id),
   ``rank_offset`` (= the number of trainer ranks T: trainer ranks are ``[0, T)``, workers
   ``[T, T + N)``), ``world_size`` (T + N), ``dst_mesh_dims`` (the workers as a 2-D mesh:
   axis 0 replicates, axis 1 shards; ``(DP, TP)``), ``source_digest`` and ``params`` (per
   tensor, in round order: ``name``, ``dtype_name`` (torch's name), full ``shape``, the
   trainer mesh ``src_mesh_dims`` and ``src_placements``: per mesh axis -1 (replicate) or the
   tensor dim it shards; ``null`` for a tensor every trainer rank holds whole), optional
   ``nccl_unique_id_b64`` and ``max_cta``. ``init_info`` builds it; the digest is the SHA-256
   of the canonical JSON of ``{"schema_version", "params"}`` (``source_digest``).
2. **Metadata agreement** over the rendezvous (``m2n_store``: torch's store protocol, served
   here): four all-gathers of one envelope per rank, in this order: ``source`` (the
   digest), ``data_plane`` (the unique id's SHA-256), ``runtime_ready`` (every rank built its
   M2N handle), then, after the communicator exists and the placements came, ``complete_plan``
   (the digest of source digest, destination mesh and placements). A rank's error travels
   in its envelope and every rank fails together (``check_gathered``).
3. **Communicator**: ``ncclCommInitRank(world_size, uid, rank)`` through NCCL4Py (with a
   unique id in the init info no store round trip is needed); then the first worker
   (rank T) broadcasts each tensor's destination placement as an ``int8`` (n, 2) array (-2 -2:
   whole on every worker, the full-tensor fallback through ``load_weights``; else (-1, d):
   dim d split over the TP axis, written straight into the live parameter). Every trainer
   rank receives it (``decode_placements``).
4. **Each round**: start, then ``{"names": [...]}`` (the init's names, in its order; a round
   may send a subset, in that order) posted while every trainer rank issues one
   ``nccl.m2n.reshard`` per tensor, its local shard as source; finish.

The data plane is NVIDIA's ``nccl-extensions`` (``nccl.m2n``) on NCCL4Py, the same library the
workers run: neither needs torch (CUDA Array Interface buffers: CuPy, or a single-device JAX
array). ``m2n_data`` wraps it; this module stays numpy-only and CPU-tested against vLLM's own
worker code (``tests/interop/test_vllm_m2n.py``).

What a source can send: per tensor, one tensor dim split evenly over one axis of the trainer
ranks laid out as a row-major 2-D mesh (or held whole by every rank), dtype in
``M2N_DTYPES``, 1 to 3 dims, no dim of size 0 (``layout_of``, ``check_param``); else
``StockRefusal`` names the tensor, before anything is sent.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from weightwire.backends.base import StockRefusal
from weightwire.shared.errors import SourceMismatch, TransferError
from weightwire.shared.info import encode_secret
from weightwire.shared.meta import ParamMeta
from weightwire.shared.slices import Box

BACKEND = "nccl_m2n"
SCHEMA_VERSION = 2
"""``M2N_WIRE_SCHEMA_VERSION`` of vLLM 0.33 (``m2n_common.py``)."""
REPLICATE = -1
WHOLE_ROW = -2
"""The placements broadcast's row for a tensor every worker receives whole."""
MAX_TENSOR_DIMS = 3
MAX_SOURCE_SHARDS = 16
MAX_DEST_SHARDS = 64
"""vLLM 0.33's bounds on one destination shard's sources and one source shard's targets."""
M2N_DTYPES = (
    "int8",
    "uint8",
    "float8_e4m3fn",
    "float8_e5m2",
    "float16",
    "bfloat16",
    "int32",
    "uint32",
    "float32",
    "int64",
    "uint64",
    "float64",
)
"""What ``check_transferable`` (``m2n_common.py``) accepts."""
VERSION = "0.33"


@dataclass(frozen=True)
class M2NLayout:
    """One tensor's trainer-side layout: a (d0, d1) mesh of the trainer ranks (row-major:
    rank r sits at (r // d1, r % d1)) and per axis the tensor dim it splits (-1: none), or
    ``placements=None``: every rank holds it whole."""

    dims: tuple[int, int]
    placements: tuple[int, int] | None

    @property
    def size(self) -> int:
        return self.dims[0] * self.dims[1]

    def resolved(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """The (mesh, placements) ``nccl.m2n`` is called with: a whole tensor is carried as a
        no-op split of dim 0 over a size-1 axis of the same ranks as ``(size, 1)``."""
        if self.placements is None:
            return (self.size, 1), (REPLICATE, 0)
        return self.dims, self.placements

    def box(self, shape: Sequence[int], rank: int) -> Box:
        """The part of a ``shape`` tensor trainer rank ``rank`` holds under this layout."""
        ranges = [(0, int(n)) for n in shape]
        if self.placements is not None:
            coord = (rank // self.dims[1], rank % self.dims[1])
            for axis, dim in enumerate(self.placements):
                if dim != REPLICATE:
                    part = shape[dim] // self.dims[axis]
                    lo = coord[axis] * part
                    ranges[dim] = (lo, lo + part)
        return Box(tuple(ranges))


def _factorizations(n: int) -> list[tuple[int, int]]:
    return [(n // d, d) for d in range(1, n + 1) if n % d == 0]


def layout_of(name: str, shape: Sequence[int], boxes: Sequence[Box]) -> M2NLayout:
    """The layout under which trainer rank r holds exactly ``boxes[r]`` of the tensor.

    ``StockRefusal`` when there is none: nccl_m2n splits one tensor dim, evenly, over one
    axis of the trainer ranks in row-major order (a tensor split over two mesh axes, or
    unevenly, has no M2N layout).
    """
    shape = tuple(int(n) for n in shape)
    ranks = len(boxes)
    whole = Box.whole(shape)
    if all(b == whole for b in boxes):
        return M2NLayout((ranks, 1), None)
    for dims in _factorizations(ranks):
        for axis in (0, 1):
            if dims[axis] == 1:
                continue
            for dim in range(len(shape)):
                codes = [REPLICATE, REPLICATE]
                codes[axis] = dim
                layout = M2NLayout(dims, (codes[0], codes[1]))
                if shape[dim] % dims[axis]:
                    continue
                if all(layout.box(shape, r) == b for r, b in enumerate(boxes)):
                    return layout
    held = ", ".join(f"rank {r}: {b.describe()}" for r, b in enumerate(boxes[:4]))
    raise StockRefusal(
        name,
        f"its shards ({held}{', ...' if ranks > 4 else ''}) split it in a way nccl_m2n "
        "cannot describe: it splits one tensor dim, evenly, over one axis of the trainer "
        "ranks as a row-major 2-D mesh (a tensor split over two mesh axes, or unevenly, is "
        "refused by its check_placements / validate_layout). Shard it over one mesh axis "
        "(e.g. PartitionSpec('fsdp', None)); weightwire_tcp's sliced rounds take any sharding",
        VERSION,
        backend=BACKEND,
    )


def check_param(meta: ParamMeta, layout: M2NLayout, trainer_ranks: int) -> None:
    """What vLLM's ``check_transferable`` / ``validate_layout`` refuse, refused first."""

    def refuse(reason: str) -> StockRefusal:
        return StockRefusal(meta.name, reason, VERSION, backend=BACKEND)

    if meta.dtype not in M2N_DTYPES:
        raise refuse(f"dtype {meta.dtype} is not one nccl_m2n moves ({', '.join(M2N_DTYPES)})")
    if not 1 <= len(meta.shape) <= MAX_TENSOR_DIMS:
        raise refuse(
            f"it has {len(meta.shape)} dims; nccl_m2n moves tensors of 1 to {MAX_TENSOR_DIMS} "
            "dims (reshape it on the trainer, or use the plain nccl backend)"
        )
    if any(n <= 0 for n in meta.shape):
        raise refuse(f"its shape {list(meta.shape)} has an empty dim; nccl_m2n refuses it")
    if layout.size != trainer_ranks:
        raise refuse(f"its mesh covers {layout.size} ranks, the trainer has {trainer_ranks}")


@dataclass(frozen=True)
class M2NParam:
    """One tensor of the plan: its metadata and its trainer-side layout."""

    meta: ParamMeta
    layout: M2NLayout

    def wire(self) -> dict[str, Any]:
        """Its ``params`` entry of the init info (and of the digest)."""
        return {
            "name": self.meta.name,
            "dtype_name": self.meta.dtype,
            "shape": list(self.meta.shape),
            "src_mesh_dims": list(self.layout.dims),
            "src_placements": (
                None if self.layout.placements is None else list(self.layout.placements)
            ),
        }

    def local_shape(self, rank: int) -> tuple[int, ...]:
        return self.layout.box(self.meta.shape, rank).shape


def _digest(payload: Mapping[str, Any]) -> str:
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def source_digest(params: Sequence[M2NParam]) -> str:
    """The init info's ``source_digest`` (the worker recomputes and compares it)."""
    return _digest({"schema_version": SCHEMA_VERSION, "params": [p.wire() for p in params]})


def complete_digest(
    source: str,
    dst_dims: tuple[int, int],
    first_worker: int,
    placements: Sequence[tuple[int, int] | None],
) -> str:
    """The digest every rank publishes in the ``complete_plan`` phase."""
    return _digest(
        {
            "schema_version": SCHEMA_VERSION,
            "source_digest": source,
            "destination_mesh": {"dims": list(dst_dims), "start_rank": first_worker},
            "destination_placements": [None if p is None else list(p) for p in placements],
        }
    )


def init_info(
    params: Sequence[M2NParam],
    *,
    master_address: str,
    master_port: int,
    trainer_ranks: int,
    world_size: int,
    dst_mesh_dims: tuple[int, int],
    unique_id: bytes,
    max_cta: int | None = None,
) -> dict[str, Any]:
    """The stock worker's init info (step 1 of the module docstring)."""
    if dst_mesh_dims[0] * dst_mesh_dims[1] != world_size - trainer_ranks:
        raise ValueError(
            f"dst_mesh_dims {list(dst_mesh_dims)} must cover the "
            f"{world_size - trainer_ranks} workers"
        )
    out: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "master_address": master_address,
        "master_port": int(master_port),
        "nccl_unique_id_b64": encode_secret(unique_id),
        "rank_offset": trainer_ranks,
        "world_size": world_size,
        "dst_mesh_dims": list(dst_mesh_dims),
        "source_digest": source_digest(params),
        "params": [p.wire() for p in params],
    }
    if max_cta is not None:
        out["max_cta"] = int(max_cta)
    return out


def update_info(params: Sequence[M2NParam]) -> dict[str, Any]:
    """One round's update info: the names, in the order the reshards are issued."""
    return {"names": [p.meta.name for p in params]}


def decode_placements(rows: np.ndarray, n: int) -> list[tuple[int, int] | None]:
    """The first worker's broadcast of destination placements, as per-tensor placements
    (``None``: the whole tensor to every worker)."""
    rows = np.asarray(rows)
    if rows.shape != (n, 2) or rows.dtype != np.int8:
        raise TransferError(
            f"the workers' placements broadcast is {rows.dtype} {list(rows.shape)}, expected "
            f"int8 [{n}, 2]"
        )
    out: list[tuple[int, int] | None] = []
    for a, b in rows.tolist():
        out.append(None if (a, b) == (WHOLE_ROW, WHOLE_ROW) else (int(a), int(b)))
    return out


def _max_overlaps(extent: int, parts: int, other: int) -> int:
    width, other_width = extent // parts, extent // other
    return max(
        (i * width + width - 1) // other_width - (i * width) // other_width + 1
        for i in range(parts)
    )


def check_destinations(
    params: Sequence[M2NParam],
    dst_dims: tuple[int, int],
    placements: Sequence[tuple[int, int] | None],
) -> None:
    """vLLM's ``validate_transfer_plan`` on the trainer's side: every destination splits
    evenly and stays inside M2N's fan-in / fan-out bounds. Raises ``ValueError`` (the
    message goes into this rank's ``complete_plan`` envelope, so every rank fails)."""
    if len(placements) != len(params):
        raise ValueError(f"{len(placements)} destination placements for {len(params)} tensors")
    workers = dst_dims[0] * dst_dims[1]
    for p, place in zip(params, placements, strict=True):
        shape = p.meta.shape
        dst = M2NLayout(dst_dims, place) if place is not None else M2NLayout((workers, 1), None)
        dst_mesh, dst_place = dst.resolved()
        src_mesh, src_place = p.layout.resolved()
        for mesh, place_, side in (
            (src_mesh, src_place, "source"),
            (dst_mesh, dst_place, "destination"),
        ):
            if sum(c != REPLICATE for c in place_) != 1 or any(c < REPLICATE for c in place_):
                raise ValueError(
                    f"'{p.meta.name}' {side} placements {list(place_)} are not one split"
                )
            for axis, dim in enumerate(place_):
                if dim != REPLICATE and (dim >= len(shape) or shape[dim] % mesh[axis]):
                    raise ValueError(
                        f"'{p.meta.name}' {side} layout splits dim {dim} of {list(shape)} over "
                        f"{mesh[axis]} ranks, which does not divide it"
                    )
        s_axis = next(a for a, c in enumerate(src_place) if c != REPLICATE)
        d_axis = next(a for a, c in enumerate(dst_place) if c != REPLICATE)
        s_dim, s_n = src_place[s_axis], src_mesh[s_axis]
        d_dim, d_n = dst_place[d_axis], dst_mesh[d_axis]
        if s_dim != d_dim:
            sources, targets = s_n, d_n
        else:
            sources = _max_overlaps(shape[s_dim], d_n, s_n)
            targets = _max_overlaps(shape[s_dim], s_n, d_n)
        if sources > MAX_SOURCE_SHARDS or targets > MAX_DEST_SHARDS:
            raise ValueError(
                f"'{p.meta.name}' would take {sources} source shards into one destination "
                f"shard (max {MAX_SOURCE_SHARDS}) or send one source shard to {targets} "
                f"destination shards (max {MAX_DEST_SHARDS})"
            )


# -- the agreement phases (step 2) ------------------------------------------------------------


def source_envelope(digest: str, error: str | None = None) -> dict[str, Any]:
    ok = error is None
    return {
        "phase": "source",
        "digest": digest if ok else None,
        "declared_digest": digest,
        "error": error,
    }


def data_plane_envelope(unique_id: bytes) -> dict[str, Any]:
    return {
        "phase": "data_plane",
        "mode": "uid",
        "uid_digest": hashlib.sha256(unique_id).hexdigest(),
        "error": None,
    }


def runtime_envelope(error: str | None) -> dict[str, Any]:
    return {"phase": "runtime_ready", "error": error}


def complete_envelope(digest: str | None, error: str | None) -> dict[str, Any]:
    return {"phase": "complete_plan", "digest": None if error else digest, "error": error}


PHASE_FIELDS = {
    "source": {"phase", "digest", "declared_digest", "error"},
    "data_plane": {"phase", "mode", "uid_digest", "error"},
    "runtime_ready": {"phase", "error"},
    "complete_plan": {"phase", "digest", "error"},
}
_AGREE = {"source": "digest", "data_plane": "uid_digest", "complete_plan": "digest"}


def check_gathered(phase: str, gathered: Sequence[Any], trainer_ranks: int) -> None:
    """Every rank's envelope of ``phase``: raise ``TransferError`` naming each rank that
    failed (a worker's error text is vLLM's, e.g. the missing ``nccl-extensions`` package)
    or that disagrees with rank 0."""
    errors: list[str] = []

    def who(rank: int) -> str:
        return f"trainer rank {rank}" if rank < trainer_ranks else f"worker rank {rank}"

    values: dict[int, Any] = {}
    for rank, item in enumerate(gathered):
        if not isinstance(item, dict) or set(item) != PHASE_FIELDS[phase] or item["phase"] != phase:
            errors.append(f"{who(rank)}: not a {phase} envelope")
        elif item["error"] is not None:
            errors.append(f"{who(rank)}: {item['error']}")
        elif phase in _AGREE:
            values[rank] = item[_AGREE[phase]]
    if not errors and values:
        first = values.get(0)
        errors += [f"{who(r)} disagrees with rank 0" for r, v in values.items() if v != first]
    if errors:
        raise TransferError(
            f"the nccl_m2n {phase} agreement failed, before any tensor moved: " + "; ".join(errors)
        )


def plan_bytes(
    params: Sequence[M2NParam],
    placements: Sequence[tuple[int, int] | None],
    dst_dims: tuple[int, int],
) -> list[int]:
    """Per worker (in rank order after the trainer's), the bytes one round writes into it:
    a directly placed tensor's split part, a fallback tensor whole."""
    workers = dst_dims[0] * dst_dims[1]
    out = [0] * workers
    for p, place in zip(params, placements, strict=True):
        whole = math.prod(p.meta.shape) * p.meta.itemsize
        for w in range(workers):
            if place is None:
                out[w] += whole
            else:
                out[w] += M2NLayout(dst_dims, place).box(p.meta.shape, w).volume * p.meta.itemsize
    return out


# -- the session (steps 1 to 4) -------------------------------------------------------------


class M2NDataPlane(Protocol):
    """What a session drives: ``m2n_data.NcclM2NDataPlane`` on GPUs (trainer ranks
    ``[0, ranks)`` of this process), a fake of the same calls in CPU tests."""

    @property
    def ranks(self) -> int: ...

    def prepare(self) -> None: ...

    def connect(
        self,
        world_size: int,
        unique_id: bytes,
        *,
        timeout_s: float,
        check: Callable[[], None] | None = ...,
    ) -> None: ...

    def placements(
        self, n: int, root: int, *, timeout_s: float, check: Callable[[], None] | None = ...
    ) -> np.ndarray: ...

    def reshard(
        self,
        shards: Sequence[Any],
        src: tuple[tuple[int, int], tuple[int, int]],
        dst: tuple[tuple[int, int], tuple[int, int]],
        first_worker: int,
    ) -> None: ...

    def wait(
        self, *, timeout_s: float, what: str = ..., check: Callable[[], None] | None = ...
    ) -> None: ...

    def abort(self) -> None: ...

    def close(self) -> None: ...


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class StockM2NSession:
    """One trainer process driving a stock vLLM 0.33 ``nccl_m2n`` server (every trainer
    rank of the plan is a device of this process: ``data.ranks``).

    ``open()`` runs the init (steps 1-3); each ``send(shards)`` one round (step 4), where
    ``shards[i][r]`` is trainer rank r's part of ``params[i]`` (a CUDA array: nothing is
    gathered); ``close()`` releases the store and the communicators. A round that fails
    after its first reshard leaves the workers' communicator unusable (vLLM's receiver has
    no timeout): close the session and restart the server's engine
    (``/shutdown_weight_transfer_engine``, then a new ``open()``).

    The trainer engines (``backends.nccl.m2n_trainer``) drive the same steps through their
    own round: ``listen`` (the init info to post), ``join`` beside that POST, then per tensor
    ``check_parts`` / ``reshard`` and ``wait``.
    """

    def __init__(
        self,
        client: Any,
        params: Sequence[M2NParam],
        data: M2NDataPlane,
        *,
        workers: int,
        host: str,
        unique_id: bytes,
        dst_mesh_dims: tuple[int, int] | None = None,
        timeout_s: float = 300.0,
        max_cta: int | None = None,
        advertise: str | None = None,
    ) -> None:
        self.client, self.params, self.data = client, list(params), data
        self.trainer_ranks = data.ranks
        self.workers = int(workers)
        self.world_size = self.trainer_ranks + self.workers
        self.dst_dims = dst_mesh_dims or (self.workers, 1)
        self.host, self.unique_id, self.timeout_s = host, unique_id, float(timeout_s)
        self.advertise = advertise or host
        self.max_cta = max_cta
        self.placements: list[tuple[int, int] | None] = []
        self.info: dict[str, Any] | None = None
        self._store: Any = None
        self._broken: str | None = None
        names = [p.meta.name for p in self.params]
        if len(set(names)) != len(names):
            raise ValueError("nccl_m2n params name a tensor twice")
        self.index = {name: i for i, name in enumerate(names)}
        for p in self.params:
            check_param(p.meta, p.layout, self.trainer_ranks)

    def _background(self, call: Any, *args: Any) -> Future[Any]:
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="m2n-control")
        try:
            return pool.submit(call, *args)
        finally:
            pool.shutdown(wait=False)

    @staticmethod
    def _raise_if_failed(fut: Future[Any]) -> None:
        if fut.done() and fut.exception() is not None:
            raise fut.exception()  # type: ignore[misc]

    def listen(self) -> dict[str, Any]:
        """Step 1: the metadata store is served (on ``host``) and the init info built (the
        workers dial ``advertise``); post it to the server while ``join`` runs."""
        from weightwire.backends.nccl.m2n_store import MetadataStore

        store = MetadataStore(self.host)
        self._store = store
        self.info = init_info(
            self.params,
            master_address=self.advertise,
            master_port=store.port,
            trainer_ranks=self.trainer_ranks,
            world_size=self.world_size,
            dst_mesh_dims=self.dst_dims,
            unique_id=self.unique_id,
            max_cta=self.max_cta,
        )
        return self.info

    def join(
        self, *, check: Callable[[], None] | None = None, timeout_s: float | None = None
    ) -> None:
        """Steps 2-3, beside the init POST: the four agreement phases, the communicator and
        the workers' placements, each wait bounded by ``timeout_s`` (default the session's)
        and ended sooner when ``check`` raises (the init call failed). On failure the session
        is closed."""
        assert self.info is not None and self._store is not None, "listen() first"
        t, wait_s = self.trainer_ranks, self.timeout_s if timeout_s is None else timeout_s
        from weightwire.backends.nccl.m2n_store import MetadataGroup

        group = MetadataGroup(self._store, self.world_size, timeout_s=wait_s, own=t, check=check)
        try:
            digest = self.info["source_digest"]
            check_gathered("source", group.all_gather_obj(source_envelope(digest)), t)
            check_gathered(
                "data_plane", group.all_gather_obj(data_plane_envelope(self.unique_id)), t
            )
            failed: BaseException | None = None
            try:
                self.data.prepare()
            except Exception as exc:  # told to every rank first, so the workers fail too
                failed = exc
            gathered = group.all_gather_obj(
                runtime_envelope(None if failed is None else _error_text(failed))
            )
            if failed is not None:
                raise failed
            check_gathered("runtime_ready", gathered, t)
            self.data.connect(self.world_size, self.unique_id, timeout_s=wait_s, check=check)
            rows = self.data.placements(len(self.params), t, timeout_s=wait_s, check=check)
            placements = decode_placements(rows, len(self.params))
            plan_error: str | None = None
            try:
                check_destinations(self.params, self.dst_dims, placements)
            except ValueError as exc:
                plan_error = _error_text(exc)
            whole = complete_digest(digest, self.dst_dims, t, placements)
            check_gathered(
                "complete_plan", group.all_gather_obj(complete_envelope(whole, plan_error)), t
            )
        except BaseException:
            self.close()
            raise
        self.placements = placements

    def open(self) -> None:
        info = self.listen()
        posted = self._background(self.client.init_weight_transfer_engine, info)
        try:
            self.join(check=lambda: self._raise_if_failed(posted))
            posted.result(timeout=self.timeout_s)
        except BaseException:
            self.close()
            raise

    def _dst(self, i: int) -> tuple[tuple[int, int], tuple[int, int]]:
        place = self.placements[i]
        if place is None:
            return M2NLayout((self.workers, 1), None).resolved()
        return M2NLayout(self.dst_dims, place).resolved()

    def check_round(self, metas: Sequence[ParamMeta]) -> None:
        """A round of ``metas`` sends tensors the init declared, each once, with the declared
        dtype and shape (vLLM's receiver refuses an undeclared name; a changed dtype or shape
        would reshard into the wrong buffer): ``SourceMismatch`` naming the first that is not."""
        seen: set[str] = set()
        for m in metas:
            i = self.index.get(m.name)
            if i is None:
                raise SourceMismatch(
                    f"'{m.name}' was not declared at the nccl_m2n init (its {len(self.params)} "
                    "tensors are fixed for the session): shutdown() and trainer_init() again to "
                    "send another set of tensors"
                )
            declared = self.params[i].meta
            if (m.dtype, tuple(m.shape)) != (declared.dtype, tuple(declared.shape)):
                raise SourceMismatch(
                    f"'{m.name}' is {m.dtype} {list(m.shape)}; the nccl_m2n init declared "
                    f"{declared.dtype} {list(declared.shape)} (the layouts are fixed for the "
                    "session: shutdown() and trainer_init() again)"
                )
            if m.name in seen:
                raise SourceMismatch(f"'{m.name}' is sent twice in one nccl_m2n round")
            seen.add(m.name)

    def check_parts(self, name: str, parts: Sequence[Any]) -> None:
        """Each trainer rank's part of tensor ``name`` has the shape its layout says."""
        p = self.params[self.index[name]]
        if len(parts) != self.trainer_ranks:
            raise SourceMismatch(
                f"'{p.meta.name}': {len(parts)} shards for {self.trainer_ranks} trainer ranks"
            )
        for r, part in enumerate(parts):
            want = p.local_shape(r)
            if tuple(part.shape) != want:
                raise SourceMismatch(
                    f"'{p.meta.name}' on trainer rank {r} is {list(part.shape)}; its layout "
                    f"says {list(want)} (the source's sharding changed: open a new session)"
                )

    def _check_shards(self, shards: Sequence[Sequence[Any]]) -> None:
        if len(shards) != len(self.params):
            raise SourceMismatch(
                f"the round has {len(shards)} tensors' shards; the session declared "
                f"{len(self.params)}"
            )
        for p, parts in zip(self.params, shards, strict=True):
            self.check_parts(p.meta.name, parts)

    def reshard(self, name: str, parts: Sequence[Any]) -> int:
        """Tensor ``name``'s reshard, every local rank its part (checked first); returns the
        bytes the workers receive of it."""
        i = self.index[name]
        p = self.params[i]
        self.data.reshard(parts, p.layout.resolved(), self._dst(i), self.trainer_ranks)
        shape = p.meta.shape
        dst = self.placements[i]
        per = [
            (M2NLayout(self.dst_dims, dst).box(shape, w).volume if dst else math.prod(shape))
            for w in range(self.workers)
        ]
        return sum(per) * p.meta.itemsize

    def wait(self, *, check: Callable[[], None] | None = None) -> None:
        self.data.wait(timeout_s=self.timeout_s, check=check)

    def send(self, shards: Sequence[Sequence[Any]], weight_version: str = "") -> None:
        """One round: every shard checked first (nothing is sent for a wrong one), then
        start, the update posted beside one reshard per tensor, finish."""
        if self._broken is not None:
            raise TransferError(
                f"this nccl_m2n session is broken by a failed round ({self._broken}): close() "
                "it, POST /shutdown_weight_transfer_engine to the server and open a new one"
            )
        if not self.placements and self.params:
            raise TransferError("the nccl_m2n session is not open (open() first)")
        self._check_shards(shards)
        self.client.start_weight_update()
        try:
            posted = self._background(self.client.update_weights, update_info(self.params))
            for p, parts in zip(self.params, shards, strict=True):
                self._raise_if_failed(posted)
                self.reshard(p.meta.name, parts)
            self.wait(check=lambda: self._raise_if_failed(posted))
            posted.result(timeout=self.timeout_s)
        except BaseException as exc:
            # vLLM's receiver has no timeout and its collectives cannot be resumed: the
            # communicator is spent, whatever the workers did with the round
            self._broken = _error_text(exc)
            self.data.close()
            raise
        self.client.finish_weight_update(weight_version)

    def abort(self) -> None:
        """Aborts the communicators (a stuck reshard returns), from any thread; the handles
        a running round may still use and the store go at ``close``, once it settled."""
        self.data.abort()

    def close(self) -> None:
        store, self._store = self._store, None
        try:
            self.data.close()
        finally:
            if store is not None:
                store.close()


# -- a JAX source (duck-typed: nothing here imports jax) ---------------------------------------


def _index_box(index: Sequence[slice], shape: Sequence[int]) -> Box:
    ranges = []
    for s, n in zip(index, shape, strict=True):
        lo, hi, step = s.indices(int(n))
        if step != 1:
            raise ValueError(f"a shard index steps by {step}; only contiguous shards are held")
        ranges.append((lo, max(lo, hi)))
    return Box(tuple(ranges))


def params_of_arrays(arrays: Mapping[str, Any], devices: Sequence[Any]) -> list[M2NParam]:
    """The plan of ``arrays`` (``jax.Array``s, in round order) whose trainer rank r is
    ``devices[r]`` (e.g. ``list(mesh.devices.flat)``: row-major over the mesh): each tensor's
    layout read from its sharding (metadata only). ``StockRefusal`` for a tensor not on
    every one of ``devices`` or split in a way nccl_m2n cannot describe."""
    from weightwire.shared.dtypes import wire_name_of_numpy

    out = []
    for name, a in arrays.items():
        shape = tuple(int(n) for n in a.shape)
        index_map = a.sharding.devices_indices_map(shape)
        missing = [r for r, d in enumerate(devices) if d not in index_map]
        if missing:
            raise StockRefusal(
                name,
                f"it is not placed on trainer rank {missing[0]}'s device {devices[missing[0]]}; "
                "nccl_m2n needs every tensor on every trainer rank's device (whole or split)",
                VERSION,
                backend=BACKEND,
            )
        boxes = [_index_box(index_map[d], shape) for d in devices]
        meta = ParamMeta(name, wire_name_of_numpy(a.dtype), shape)
        out.append(M2NParam(meta, layout_of(name, shape, boxes)))
    return out


def shards_of_arrays(arrays: Mapping[str, Any], devices: Sequence[Any]) -> list[list[Any]]:
    """One round's ``send`` argument: per tensor, each trainer rank's own shard (the
    single-device array its device holds: a view, no copy, no gather), computed and ready."""
    out = []
    for name, a in arrays.items():
        by_device = {s.device: s.data for s in a.addressable_shards}
        try:
            parts = [by_device[d] for d in devices]
        except KeyError as exc:
            raise SourceMismatch(
                f"'{name}' has no shard on device {exc.args[0]} of this process (its sharding "
                "changed since the session opened: open a new session)"
            ) from None
        for p in parts:
            ready = getattr(p, "block_until_ready", None)
            if ready is not None:
                ready()  # nccl.m2n reads on its own stream: XLA's writes must be done
        out.append(parts)
    return out
