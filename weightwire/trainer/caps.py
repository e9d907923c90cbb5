"""``ClientCaps``: which optional calls the engine's client offers, probed once.

A client needs only the four round calls (``shared.client.ROUND_CALLS``); everything else
(pause, cache resets, the round guard, the reference server's combined calls, ...) is
optional, and the trainer adapts to what is there. The calls a client offers cannot change
while the engine holds it, so they are probed once, after ``control.fallback`` filled in
what it could (``trainer_init``, and again when ``reopen_wire`` opens a fresh wire), and the
record is read wherever a round decides.

The probe is ``callable(getattr(client, name, None))`` on purpose, not ``isinstance`` against
a ``runtime_checkable`` Protocol: on Python 3.12+ that ignores a call ``FallbackClient``
forwards through ``__getattr__``, so a filled-in pause would read as missing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass(frozen=True)
class ClientCaps:
    """One flag per call: whether the client offers it (a field's name is the call's name).
    The four round calls are here too: ``gating.check_client`` refuses a client without one."""

    init_weight_transfer_engine: bool = False
    start_weight_update: bool = False
    update_weights: bool = False
    finish_weight_update: bool = False
    version: bool = False
    get_world_size: bool = False
    pause: bool = False
    resume: bool = False
    weight_checker: bool = False
    reset_prefix_cache: bool = False
    reset_encoder_cache: bool = False
    round_guard: bool = False
    """``round_guard()``: the servers' round guard states (``gating.guard_installed``)."""
    has_draft_model: bool = False
    """``has_draft_model()``: every server confirms a speculative draft model."""
    start_draft_weight_update: bool = False
    """The draft route: a draft round starts with it."""
    starts_with_pause: bool = False
    """The reference server's start that pauses first (``early.starts_with_pause``)."""
    finishes_with_resume: bool = False
    """The reference server's finish that resets the caches and resumes."""
    updates_with_finish: bool = False
    """The reference server's update that commits the round (``freshness.FinishInUpdate``)."""
    updates_with_start: bool = False
    """The reference server's update that also starts the round (``early.one_request``)."""
    served_model: bool = False
    """``served_model()``: what the servers said at init about the tensors they take."""
    workers_served_model: bool = False
    """``workers_served_model()``: the same, asked of weightwire's workers."""
    shutdown_weight_transfer_engine: bool = False
    bound_waits: bool = False
    """``bound_waits(s)``: the client's wait pauses give up before the engine's ``http_s``."""

    @classmethod
    def of(cls, client: object) -> ClientCaps:
        """The calls ``client`` offers now (``None``: none, e.g. a rank that sends nothing)."""
        return cls(**{f.name: callable(getattr(client, f.name, None)) for f in fields(cls)})

    @property
    def can_pause(self) -> bool:
        """Both halves of a pause: one without its resume is no pause."""
        return self.pause and self.resume

    def lacks(self, calls: list[str]) -> list[str]:
        """The calls in ``calls`` (field names) the client does not offer, in their order."""
        offered = asdict(self)
        return [c for c in calls if not offered[c]]
