"""``TCPInitInfo``: the init info of ``weightwire_tcp``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from weightwire.shared.errors import ConfigError
from weightwire.shared.info import (
    DEFAULT_PACKED_NUM_BUFFERS,
    TCP_SECRET_BYTES,
    StrictInfo,
    check_host,
    check_listener,
    check_type,
    decode_secret,
)
from weightwire.shared.limits import DEFAULT_STAGE_BUDGET_BYTES


@dataclass(frozen=True, kw_only=True, repr=False)
class TCPInitInfo(StrictInfo):
    """``weightwire_tcp``: the trainer (rank 0) listens at ``host:port``; each worker
    connects and proves ``secret_b64`` (128 random bytes) before any weight byte flows.

    Several broadcasting trainer ranks: ``sources`` lists the endpoints of group ranks
    ``1 .. B-1`` (``{"host", "port", "secret_b64"}`` each; ``host``/``port``/``secret_b64``
    above are rank 0's), so ``B = 1 + len(sources)`` broadcasters. Every broadcaster listens
    on its own endpoint and every worker dials all of them, so each turn's bytes come
    straight from its ``src``; in each broadcaster's star the worker is rank
    ``rank - B + 1`` of ``world_size - B + 1``. ``rank_offset`` is where this server's
    workers start: ``B`` for the first server, more for later data-parallel servers."""

    @property
    def broadcasters(self) -> int:
        return 1 + (0 if self.sources is None else len(self.sources))

    _secret_fields: ClassVar[tuple[str, ...]] = ("secret_b64",)

    host: str
    port: int
    secret_b64: str
    rank_offset: int
    world_size: int
    packed: bool = True
    packed_buffer_size_bytes: int = 64 << 20
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    timeout_s: float = 300.0
    sources: list[dict[str, Any]] | None = None
    stage_budget_bytes: int = DEFAULT_STAGE_BUDGET_BYTES
    delta_rounds: bool | None = None
    """The trainer may send delta rounds (``TrainerInitInfo.delta``); left out when unset."""
    sliced: bool | None = None
    """The trainer may send sliced rounds (``TrainerInitInfo.sliced``): each worker sends its
    wants in its warm-up hello. Left out when unset (a worker that predates it never sees it)."""

    def __post_init__(self) -> None:
        ctx = type(self).__name__
        check_listener(ctx, self)
        got = 0 if self.sources is None else len(self.sources)
        if got + 1 > self.rank_offset:
            raise ConfigError(
                f"{ctx}.sources lists {got} broadcasting rank(s) besides rank 0, but rank_offset "
                f"{self.rank_offset} leaves only {self.rank_offset - 1} trainer rank(s) "
                "below the workers"
            )
        _ = self.endpoints

    @property
    def secret(self) -> bytes:
        return decode_secret(f"{type(self).__name__}.secret_b64", self.secret_b64, TCP_SECRET_BYTES)

    @property
    def endpoints(self) -> list[tuple[str, int, bytes]]:
        """``(host, port, secret)`` of every broadcaster, by group rank (rank 0 first)."""
        ctx = type(self).__name__
        out = [(self.host, self.port, self.secret)]
        for i, item in enumerate(self.sources or (), start=1):
            where = f"{ctx}.sources[{i - 1}]"
            if not isinstance(item, dict) or set(item) != {"host", "port", "secret_b64"}:
                raise ConfigError(f"{where} must be an object with exactly host, port, secret_b64")
            host, port = item["host"], item["port"]
            check_type(f"{where}.host", host, str, optional=False)
            check_type(f"{where}.port", port, int, optional=False)
            check_host(f"{where}.host", host)
            if not 1 <= port <= 65535:
                raise ConfigError(f"{where}.port must be in [1, 65535], got {port}")
            out.append(
                (
                    host,
                    port,
                    decode_secret(f"{where}.secret_b64", item["secret_b64"], TCP_SECRET_BYTES),
                )
            )
        return out
