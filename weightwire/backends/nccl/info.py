"""The init infos of the NCCL backends: vLLM's own ``nccl`` (and ``sparse_nccl``) and
``weightwire_nccl`` (the same fields plus a receive timeout and the stage budget)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from weightwire.shared.checks import check_seconds
from weightwire.shared.errors import ConfigError
from weightwire.shared.info import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    DEFAULT_PACKED_NUM_BUFFERS,
    MAX_TIMEOUT_S,
    StrictInfo,
    check_host,
    check_wire_params,
    decode_secret,
)
from weightwire.shared.limits import DEFAULT_STAGE_BUDGET_BYTES
from weightwire.shared.staging import check_stage_budget

NCCL_UNIQUE_ID_BYTES = 128


@dataclass(frozen=True, kw_only=True, repr=False)
class NCCLInitInfo(StrictInfo):
    """Worker init info for vLLM's dense ``nccl`` backend (and ``weightwire_nccl``).

    Exactly one rendezvous: ``master_address`` + ``master_port`` (torch TCPStore) or
    ``nccl_unique_id_b64`` (a torch-free trainer mints the id). Defaults are vLLM's
    worker defaults (``packed`` false); our trainer engines always send all three wire
    params explicitly so the two sides cannot disagree.
    """

    _secret_fields: ClassVar[tuple[str, ...]] = ("nccl_unique_id_b64",)

    master_address: str | None = None
    master_port: int | None = None
    nccl_unique_id_b64: str | None = None
    rank_offset: int
    world_size: int
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS

    def __post_init__(self) -> None:
        ctx = type(self).__name__
        store = self.master_address is not None or self.master_port is not None
        if store and self.nccl_unique_id_b64 is not None:
            raise ConfigError(
                f"{ctx}: give either master_address/master_port or nccl_unique_id_b64, not both"
            )
        if not store and self.nccl_unique_id_b64 is None:
            raise ConfigError(
                f"{ctx}: no rendezvous: give master_address/master_port or nccl_unique_id_b64"
            )
        if store and (self.master_address is None or self.master_port is None):
            raise ConfigError(f"{ctx}: master_address and master_port must be given together")
        if self.master_address is not None:
            check_host(f"{ctx}.master_address", self.master_address)
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise ConfigError(f"{ctx}.master_port must be in [1, 65535], got {self.master_port}")
        _ = self.unique_id_bytes
        check_wire_params(
            ctx,
            self.packed_buffer_size_bytes,
            self.packed_num_buffers,
            self.world_size,
            self.rank_offset,
        )

    @property
    def unique_id_bytes(self) -> bytes | None:
        if self.nccl_unique_id_b64 is None:
            return None
        return decode_secret(
            f"{type(self).__name__}.nccl_unique_id_b64",
            self.nccl_unique_id_b64,
            NCCL_UNIQUE_ID_BYTES,
        )


@dataclass(frozen=True, kw_only=True, repr=False)
class WeightwireNCCLInitInfo(NCCLInitInfo):
    """``weightwire_nccl``: vLLM's fields plus a receive timeout (stock vLLM has none) and
    the stage budget (``shared.staging``)."""

    timeout_s: float = 300.0
    stage_budget_bytes: int = DEFAULT_STAGE_BUDGET_BYTES
    delta_rounds: bool | None = None
    """The trainer may send delta rounds (``TrainerInitInfo.delta``); left out when unset."""
    sliced: bool | None = None
    """The trainer may send sliced rounds (``TrainerInitInfo.sliced``): each worker sends its
    wants on the communicator right after the warm-up (``backends.nccl.slices``). Left out
    when unset (a worker that predates it never sees it)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check_seconds(f"{type(self).__name__}.timeout_s", self.timeout_s, most=MAX_TIMEOUT_S)
        check_stage_budget(f"{type(self).__name__}.stage_budget_bytes", self.stage_budget_bytes)


@dataclass(frozen=True, kw_only=True, repr=False)
class M2NInitInfo(StrictInfo):
    """Worker init info of vLLM 0.33's ``nccl_m2n`` receiver (``M2NWeightTransferInitInfo``:
    the metadata rendezvous, the trainer ranks and the workers' mesh, and every tensor's
    trainer-side layout; ``backends.nccl.stock_m2n`` builds it). The checks are vLLM's
    ``__post_init__``'s, so rank 0 refuses what the workers would refuse, before the POST;
    the params' digest is checked by the workers (``parse_wire_params``)."""

    _secret_fields: ClassVar[tuple[str, ...]] = ("nccl_unique_id_b64",)

    schema_version: int
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    dst_mesh_dims: list
    source_digest: str
    params: list
    nccl_unique_id_b64: str | None = None
    max_cta: int | None = None

    def __post_init__(self) -> None:
        ctx = type(self).__name__
        check_host(f"{ctx}.master_address", self.master_address)
        if not 0 < self.master_port < 65536:
            raise ConfigError(f"{ctx}.master_port must be in [1, 65535], got {self.master_port}")
        if not 1 <= self.rank_offset < self.world_size:
            raise ConfigError(
                f"{ctx}: rank_offset ({self.rank_offset}) must leave at least one trainer rank "
                f"and one worker in world_size {self.world_size}"
            )
        dims = self.dst_mesh_dims
        workers = self.world_size - self.rank_offset
        if (
            len(dims) != 2
            or not all(type(d) is int and d > 0 for d in dims)
            or dims[0] * dims[1] != workers
        ):
            raise ConfigError(
                f"{ctx}.dst_mesh_dims {dims!r} must be two positive dims covering the "
                f"{workers} inference workers"
            )
        if not self.source_digest or not all(isinstance(p, dict) for p in self.params):
            raise ConfigError(f"{ctx}: source_digest and params (one mapping each) are required")
        if self.nccl_unique_id_b64 is not None:
            decode_secret(
                f"{ctx}.nccl_unique_id_b64", self.nccl_unique_id_b64, NCCL_UNIQUE_ID_BYTES
            )
