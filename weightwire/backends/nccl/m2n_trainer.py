"""Rank 0's side of vLLM 0.33's ``nccl_m2n`` as a trainer-engine backend.

``TrainerInitInfo(backend="nccl_m2n")`` runs ``stock_m2n``'s steps through the engine's own
round (``trainer.round.lead_round``: the pause, start, update beside the data plane, finish,
cache resets, metrics and the failure rules every backend gets):

- **open** (``NcclM2NBackend.open_sharded``): the source's layout (``ShardLayout``: every
  tensor's box on each trainer rank, a device of this process) becomes the plan
  (``layout_of``; ``StockRefusal`` for a split nccl_m2n cannot describe), the metadata store
  is served and the init info built (``StockM2NSession.listen``), checked as vLLM parses it
  (``M2NInitInfo``);
- **join** (``M2NRendezvous.join``, beside the init POST): the agreement phases, the
  communicator, the workers' placements (``StockM2NSession.join``);
- **each round**: ``plan_round`` writes the update info (the names, in the round's order);
  the sender (``M2NSender``) checks the round against the init (``check_round``, when it
  is planned: before any call), then per tensor reads each rank's own shard
  (``LocalShards.shards``), checks its shape, and issues one reshard, the control plane
  (start, the update POST) run before the first; the round ends once every local stream
  drained (bounded: ``Timeouts.transfer_s``).

What the stock receiver cannot do is refused at ``TrainerInitInfo``'s construction
(``check_config``: ``verify``, ``sliced="off"``; ``delta`` is refused for every stock
receiver of whole tensors), at ``trainer_init`` (a ``TrainerGroup``: the trainer ranks are one
process's devices), by ``AdapterSync`` (a stock receiver loads base weights) or at the round
(draft: ``SenderCaps.draft``). The metadata store listens on
``tcp_bind_host`` and the workers dial ``tcp_advertise_host`` (the TCP rendezvous' fields);
the workers' mesh is ``(world / inference_tensor_parallel_size, inference_tensor_parallel_size)``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

from weightwire.backends.base import (
    Backend,
    LocalShards,
    Outgoing,
    Rendezvous,
    RoundAborted,
    RoundSender,
    SenderCaps,
    SenderParts,
    SenderSettings,
    Sent,
    ShardLayout,
    WirePlan,
    missing_options,
    run_once,
)
from weightwire.backends.nccl.info import M2NInitInfo
from weightwire.backends.nccl.spec import NCCL_M2N
from weightwire.backends.nccl.stock_m2n import (
    M2NParam,
    StockM2NSession,
    layout_of,
    update_info,
)
from weightwire.shared.errors import ConfigError, TransferError
from weightwire.shared.meta import ParamMeta
from weightwire.shared.version import ServerFeatures


@runtime_checkable
class M2NOptions(Protocol):
    """What ``nccl_m2n`` reads of the trainer's settings beyond ``SenderSettings``."""

    @property
    def tcp_bind_host(self) -> str:
        """The address the metadata store (vLLM's rendezvous) listens on."""
        ...

    @property
    def tcp_advertise_host(self) -> str | None:
        """The address the workers dial (``None``: the bind host)."""
        ...

    @property
    def inference_tensor_parallel_size(self) -> int | None:
        """The servers' tensor-parallel size (``None``: 1)."""
        ...


def m2n_options(settings: SenderSettings) -> M2NOptions:
    if isinstance(settings, M2NOptions):
        return settings
    raise missing_options(settings, "M2NOptions", NCCL_M2N.name)


class NcclM2NBackend(Backend):
    """vLLM 0.33's ``nccl_m2n``: each trainer rank (a device of this process) reshards its own
    shard of every tensor into the workers' layout; no plugin."""

    name: ClassVar[str] = NCCL_M2N.name
    caps: ClassVar[SenderCaps] = SenderCaps(
        on_device=False, stock_receiver=True, local_shards=True, draft=False
    )

    def check_server(self, features: ServerFeatures) -> None:
        super().check_server(features)
        features.require("nccl_m2n", "the server's receiver is vLLM's nccl_m2n engine")

    def check_config(self, settings: SenderSettings, *, delta: str) -> None:
        if getattr(settings, "verify", False):
            raise ConfigError(
                f"backend {self.name!r} cannot verify rounds (verify=True): vLLM's nccl_m2n "
                "writes most tensors straight into each worker's slice of the live parameters, "
                "and its checksum route digests what the worker holds, not what was sent; "
                "drop verify, or verify with weightwire_tcp"
            )
        if getattr(settings, "sliced", "auto") == "off":
            raise ConfigError(
                f"backend {self.name!r} cannot broadcast (sliced='off'): vLLM's nccl_m2n "
                "reshards each trainer rank's shard into the workers' layout every round; for "
                "broadcasts of whole tensors use backend 'nccl' (inference_tensor_parallel_size "
                "left out sends every tensor whole to every worker)"
            )
        m2n_options(settings)  # settings without nccl_m2n's options: named here

    def open(self, settings: SenderSettings, *, world_size: int) -> Rendezvous:
        raise ConfigError(
            f"backend {self.name!r} is opened with the source's layout (open_sharded): its "
            "init info declares every tensor and where each trainer rank holds it"
        )

    def open_sharded(
        self, settings: SenderSettings, *, workers: int, layout: ShardLayout
    ) -> Rendezvous:
        from weightwire.backends.nccl.m2n_data import NcclM2NDataPlane, mint_m2n_unique_id

        options = m2n_options(settings)
        if (options.tcp_advertise_host or options.tcp_bind_host) in ("0.0.0.0", "::", ""):
            raise ConfigError(
                f"tcp_bind_host {options.tcp_bind_host!r} is not an address the workers can "
                "dial for nccl_m2n's metadata rendezvous; pass tcp_advertise_host"
            )
        tp = options.inference_tensor_parallel_size or 1
        if workers % tp:
            raise ConfigError(
                f"inference_tensor_parallel_size {tp} does not divide the {workers} inference "
                "workers: give the servers' --tensor-parallel-size"
            )
        params = [
            M2NParam(meta, layout_of(meta.name, meta.shape, boxes))
            for meta, boxes in zip(layout.metas, layout.boxes, strict=True)
        ]
        session = StockM2NSession(
            None,
            params,
            NcclM2NDataPlane(layout.shards.devices),
            workers=workers,
            host=options.tcp_bind_host,
            advertise=options.tcp_advertise_host,
            unique_id=mint_m2n_unique_id(),
            dst_mesh_dims=(workers // tp, tp),
            timeout_s=settings.timeouts.transfer_s,
        )
        payload = session.listen()
        try:
            M2NInitInfo.from_dict(payload)  # what vLLM's worker refuses, refused here first
        except BaseException:
            session.close()
            raise
        return M2NRendezvous(payload, session)

    def plan_round(self, metas: Sequence[ParamMeta], **_: Any) -> WirePlan:
        """The round in the source's order; its update info is vLLM's: the names."""
        metas = list(metas)
        names = update_info([M2NParam(m, _WHOLE) for m in metas])
        return WirePlan(metas, update_info=names)

    def sender(self, link: Any, settings: SenderSettings, parts: SenderParts) -> RoundSender:
        assert parts.shards is not None, "a local_shards backend is lent the source's shards"
        return M2NSender(link.session, parts.shards)


class _Whole:
    """A placeholder layout (``update_info`` reads only the names)."""


_WHOLE: Any = _Whole()


class M2NRendezvous(Rendezvous):
    """The init info to post; ``join`` runs the agreement beside that POST."""

    def __init__(self, payload: dict[str, Any], session: StockM2NSession) -> None:
        super().__init__(payload)
        self._session = session
        self._cancelled = threading.Event()

    def _check(self) -> None:
        if self._cancelled.is_set():
            raise TransferError("the nccl_m2n init was cancelled: the init call failed")

    def join(self, *, timeout: float) -> M2NLink:
        self._session.join(check=self._check, timeout_s=timeout)
        return M2NLink(self._session)

    def cancel(self) -> None:
        self._cancelled.set()


class M2NLink:
    """The joined session, as the trainer handles it between rounds."""

    def __init__(self, session: StockM2NSession) -> None:
        self.session = session

    def warmup(self, *, timeout: float | None = None) -> None:
        return None  # the communicator formed and the placements came inside the join

    def abort(self) -> None:
        self.session.abort()  # a stuck reshard returns; the round's thread still holds handles

    def close(self) -> None:
        self.session.close()


class M2NSender(RoundSender):
    """One round's reshards: per tensor each rank's own shard, the control plane before the
    first (see the module docstring)."""

    def __init__(self, session: StockM2NSession, shards: LocalShards) -> None:
        self._session, self._shards = session, shards

    def check_round(self, metas: Sequence[ParamMeta]) -> None:
        self._session.check_round(metas)

    def send(self, out: Outgoing) -> Sent:
        session, begin, stop = self._session, out.begin, out.stop
        metas = iter(out.metas)
        nbytes = sends = 0
        # Every part stays referenced until the streams are waited on: a source that makes
        # its arrays a layer group at a time drops them, and their memory could be reused
        # while nccl.m2n still reads it.
        kept: list[Any] = []

        def stopped() -> None:
            if stop.is_set():
                raise RoundAborted("the nccl_m2n round was stopped: the update call failed")

        for _chunk, tensors in out.prepared:
            for tensor in tensors:
                name = next(metas).name
                parts = self._shards.shards(name, tensor)
                kept.append(parts)
                session.check_parts(name, parts)  # the first tensor's: before any call
                begin = run_once(begin)
                stopped()
                nbytes += session.reshard(name, parts)
                sends += 1
        run_once(begin)
        session.wait(check=stopped)
        kept.clear()
        return Sent(nbytes, sends)
