"""The client protocols: what a trainer engine calls on the object that drives the servers.

A client is anything with the four round calls (``WeightSyncClient``): ours
(``control.HTTPWeightSyncClient``, ``control.RayWeightSyncClient``), vLLM's own
``HTTPVLLMWeightSyncClient``, or a user's adapter. They match structurally; none
inherits from these classes. The calls around a round (``ServerControls``) are each
optional: the engine checks the ones its configuration needs by name when it starts
(``callable(getattr(client, name, None))``), so a client that lacks one fails at
``trainer_init`` with the missing names instead of mid-round.

Parameters are positional-only: clients name them differently (``init_info`` /
``info``) and the engine always passes them positionally. Return values are ``object``:
the engine ignores what a round call returns, so any client's answer is accepted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

ROUND_CALLS = (
    "init_weight_transfer_engine",
    "start_weight_update",
    "update_weights",
    "finish_weight_update",
)
"""The four calls every client must have (the members of ``WeightSyncClient``)."""

CONTROL_CALLS = (
    "version",
    "get_world_size",
    "pause",
    "resume",
    "weight_checker",
    "start_draft_weight_update",
    "has_draft_model",
    "abort_requests",
    "shutdown_weight_transfer_engine",
    "reset_prefix_cache",
    "reset_encoder_cache",
)
"""The optional calls (the members of ``ServerControls``)."""


@runtime_checkable
class WeightSyncClient(Protocol):
    """The four round calls: open the data plane, then per round start / update / finish.

    ``update_weights`` blocks while the workers receive, so the engine calls it on a
    side thread concurrently with the broadcasts."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any], /) -> object: ...

    def start_weight_update(self) -> object: ...

    def update_weights(self, update_info: dict[str, Any], /) -> object: ...

    def finish_weight_update(self, weight_version: str, /) -> object: ...


@runtime_checkable
class ServerControls(Protocol):
    """The calls around a round; each one is optional (see the module docstring)."""

    def version(self) -> str:
        """The servers' vLLM version (feature gates); else ``TrainerInitInfo.server_version``."""
        ...

    def get_world_size(self) -> int:
        """Inference ranks across the servers; else ``TrainerInitInfo.inference_world_size``."""
        ...

    def pause(self, mode: str, /) -> object:
        """Pause generation for a round (``pause_mode``); needs ``resume``."""
        ...

    def resume(self) -> object: ...

    def weight_checker(self, action: str, /) -> Iterable[Any]:
        """One answer per server to ``/weight_checker`` (``verify=True``)."""
        ...

    def start_draft_weight_update(self) -> object:
        """Open a round into the speculative draft model (``send_weights(draft=True)``)."""
        ...

    def has_draft_model(self) -> Iterable[bool]:
        """Per server: is there a draft model? Asked before the first draft round."""
        ...

    def abort_requests(self, request_ids: list[str] | None, /) -> object: ...

    def shutdown_weight_transfer_engine(self) -> object: ...

    def reset_prefix_cache(self) -> Iterable[bool] | None:
        """After a committed round: drop every server's cached KV, running requests preempted
        (they recompute with the new weights). Per server, whether it was reset; ``None``: all
        were (a client that raised nothing). Needed unless ``reset_prefix_cache=False``."""
        ...

    def reset_encoder_cache(self) -> object:
        """After a committed round: drop cached multimodal encoder outputs (called when present)."""
        ...


class EngineClient(WeightSyncClient, ServerControls, Protocol):
    """How an engine holds its client: the round calls, and the optional calls it may
    use once it checked them present (an unchecked one is guarded where it is called)."""


def named_servers(client: object) -> list[str] | None:
    """The server URLs ``client`` names: its ``base_urls``, else its ``base_url`` as one;
    None when it names none (a Ray client, a user's adapter). A value, not a call: read
    when asked, so a client whose servers change is read as it is now. (Plain attribute
    reads: a round asks several times, and a runtime protocol check costs ~25 us each.)"""
    many: Sequence[str] | None = getattr(client, "base_urls", None)
    if many is not None:
        return list(many)
    one: str | None = getattr(client, "base_url", None)
    if one is not None:
        return [one]
    return None
