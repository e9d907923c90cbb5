"""What every route group of the reference server reads: its options and its state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from weightwire import __version__
from weightwire.backends.tcp.spec import TCP
from weightwire.shared.lora import parse_name
from weightwire.tools.server.lease import RoundLease
from weightwire.tools.server.pause import PauseGate
from weightwire.tools.server.replica import DEFAULT_MAX_REPLY_BYTES
from weightwire.tools.server.replicas import ReplicaPool
from weightwire.tools.server.session import Phase, Session
from weightwire.tools.server.web import DEFAULT_MAX_BODY_BYTES

SERVER_VERSION = f"0.33.0+weightwire.{__version__}"
"""We implement vLLM 0.33's semantics (metadata reuse, shutdown route), so clients gate on 0.33."""


@dataclass
class ServerOptions:
    backend: str = TCP.name
    model_name: str = "model"
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    op_timeout_s: float = 300.0
    """start / finish / shutdown / checksum / reset: local work on each replica."""
    round_timeout_s: float = 3600.0
    """Backstop for one update_weights (the engines time out each chunk on their own)."""
    generate_timeout_s: float = 600.0
    max_reply_bytes: int = DEFAULT_MAX_REPLY_BYTES
    """A completion whose reply could be larger is refused (400) before it runs."""
    lease_s: float | None = None
    """Round lease (see ``lease``); default: the init info's ``timeout_s`` (the trainer's
    per-broadcast bound), else ``Timeouts.from_env().transfer_s``."""
    model_dir: str | None = None
    """Shown as ``root`` by ``/v1/models``."""
    model_aliases: tuple[str, ...] = ()
    """Other ``model`` names a request may use for the served model (the ``--model`` value, its
    path)."""
    max_lora_rank: int = 0
    """Adapters up to this rank may be registered (``--enable-lora``); 0: none."""


@dataclass
class SleepState:
    """What ``/sleep`` did to the workers, as their replies said (``sleep_routes``)."""

    level: int | None = None
    """The level the server sleeps at; None: awake."""
    weights_asleep: bool = False
    """Level 1 or 2 and the weights not woken yet: a round's start is refused."""
    discarded: dict[int, int] = field(default_factory=dict)
    """Replica -> tensors ``/sleep?level=2`` discarded that no committed round has sent since."""

    @property
    def missing(self) -> int:
        return max(self.discarded.values(), default=0)

    def record(self, replies: list[Any]) -> None:
        """Take the ``discarded`` counts of the workers' sleep / wake / finish replies (in replica
        order)."""
        for index, reply in enumerate(replies):
            if isinstance(reply, dict) and isinstance(reply.get("discarded"), int):
                self.discarded[index] = reply["discarded"]

    def describe(self) -> dict[str, Any]:
        return {
            "is_sleeping": self.level is not None,
            "level": self.level,
            "discarded_tensors": self.missing,
        }


@dataclass
class ServerState:
    pool: ReplicaPool
    options: ServerOptions
    session: Session = field(default_factory=Session)
    gate: PauseGate = field(default_factory=PauseGate)
    lease: RoundLease = field(default_factory=RoundLease)
    sleep: SleepState = field(default_factory=SleepState)
    adapters: dict[str, str] = field(default_factory=dict)
    """Registered LoRA adapters: name -> the directory they were registered from."""
    listed_adapter: str | None = None
    """The adapter whose tensors the last update info that listed any named (None: the base
    model's): what an update reusing that listing (no names) writes."""
    round_adapter: tuple[int, str] | None = None
    """``(round id, adapter)``: the round an update wrote that adapter in."""

    def note_update(self, per: list[dict[str, Any]]) -> None:
        """An update of the open round, checked (one update info per replica, the same
        tensors on each): the adapter it writes, if any (``writing_adapter``)."""
        names = per[0].get("names") if per else None
        if names:
            parsed = parse_name(names[0]) if isinstance(names[0], str) else None
            self.listed_adapter = None if parsed is None else parsed.adapter
        if self.listed_adapter is not None:
            self.round_adapter = (self.session.round_id, self.listed_adapter)

    def writing_adapter(self, name: str) -> bool:
        """Whether the open round writes adapter ``name`` (an update of it named it): its
        finish swaps that adapter in, so it must stay registered until the round ends."""
        return self.session.phase is Phase.ROUND and self.round_adapter == (
            self.session.round_id,
            name,
        )

    @property
    def replicas(self) -> int:
        return len(self.pool)
