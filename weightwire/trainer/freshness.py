"""After a committed round, nothing a server serves may come from the previous weights.

vLLM keeps KV blocks of finished requests for reuse (prefix caching, on by default on
GPU) and the encoder outputs of multimodal inputs; both were computed with the weights
live when they were made, and no weight route drops them (0.30-0.33:
``finish_weight_update`` only loads). So after every committed round, rank 0 resets them
before anything can be scheduled on the new weights:

    [pause] start update finish reset_prefix_cache reset_encoder_cache [resume]

- A round paused as a whole sends the finish and both resets at once and resumes once all
  three returned: nothing is scheduled between the pause and the resume, so a cache dropped
  before the commit landed cannot be refilled from the old weights (the resets' order
  against the finish does not matter there, and each is a separate route, as vLLM has them).

- The reset asks vLLM to preempt running requests too (``reset_running_requests``), so a
  request frozen across the round (``pause`` ``keep``) or running when it landed
  recomputes its KV with the new weights instead of continuing on the old KV; and to reset
  a KV connector's external cache (``reset_external``).
- A round not paused as a whole (the plugin backends stage a round and apply it at
  finish, so ``pause_mode="auto"`` does not pause them) is reset right after its finish
  (in the finish's own request where every server offers it: ``commit_reset``), unpaused:
  a pause held across the commit would leave vLLM paused, its requests queued with nobody
  to resume them, if the trainer died inside it, which is worse than the window it closes.
  The reset preempts every request still running, so only a request that both starts and
  ends within that one round trip can have used the old KV.
  ``pause_mode="keep"`` closes the window at that price.
- ``TrainerInitInfo(reset_prefix_cache=False)`` turns all of this off, for users who
  knowingly accept stale prefixes.

A reset that fails after the commit raises ``StaleCacheError``: the round is committed
(the engine stays usable), and the message says what may be served stale and how to
clear it. Never silent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from weightwire.control.client import refused_resume
from weightwire.control.fanout import spawn
from weightwire.shared.client import EngineClient, named_servers
from weightwire.shared.errors import ControlTimeout, WeightSyncError, WeightwireError
from weightwire.trainer.caps import ClientCaps
from weightwire.trainer.config import TrainerInitInfo

logger = logging.getLogger(__name__)

_RESET_ATTEMPTS = 3
_RESET_RETRY_S = 0.1
"""vLLM answers ``success: false`` while a KV connector still holds blocks (an async
offload in flight): worth a short retry; the server is paused meanwhile when it can be."""


class StaleCacheError(WeightwireError, RuntimeError):
    """The round was committed, but a server's caches could not be reset after it."""

    committed = True

    def __init__(self, weight_version: str, detail: str) -> None:
        super().__init__(
            f"round {weight_version!r} was committed (finish_weight_update returned), but the "
            f"servers' caches were not reset: {detail}. Requests whose prefix was cached before "
            "the round may be answered from KV computed with the previous weights until a reset "
            "succeeds (the next round's, or POST /reset_prefix_cache?reset_running_requests=true); "
            "TrainerInitInfo(reset_prefix_cache=False) accepts stale prefixes knowingly"
        )
        self.weight_version = weight_version
        self.detail = detail

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.weight_version, self.detail))


@dataclass
class CommitPlan:
    """What rank 0 does around ``finish_weight_update`` (resolved once, at ``trainer_init``)."""

    reset: bool = True
    """Reset the servers' caches after every commit (``TrainerInitInfo.reset_prefix_cache``)."""

    def commit(
        self,
        client: EngineClient,
        version: str,
        *,
        caps: ClientCaps,
        record: Callable[[], None],
        paused: bool = False,
        timeout: float = 300.0,
    ) -> bool:
        """``finish_weight_update(version)``, ``record()`` as soon as it returned, then the reset
        (inside the round's pause when it has one: the caller resumes after this returns).
        ``paused``: the round is paused as a whole, so the resets go out beside the finish
        (``timeout``: the client's own per-call bound; the waits here outlast it), or with it,
        resume included, where every server offers that (``commit_resumed``).

        Returns whether the servers resumed themselves (the caller sends no resume then).
        Raises ``StaleCacheError`` when the commit held but the reset did not."""
        if paused and self.reset:
            if finishes_with_resume(client, caps):
                commit_resumed(client, version, record=record)
                return True
            commit_paused(client, version, caps=caps, record=record, timeout=timeout)
            return False
        if self.reset and finishes_with_reset(client, caps):
            commit_reset(client, version, record=record)
            return False
        client.finish_weight_update(version)
        record()
        if self.reset:
            reset_after_commit(client, version, caps)
        return False


def finishes_with_resume(client: Any, caps: ClientCaps) -> bool:
    """One server, and it advertised a finish that also resets the caches and resumes
    (``routes.FINISH_RESETS_RESUMES``: weightwire's reference server, never stock vLLM).

    With several servers the calls stay separate: a server whose finish committed would
    resume itself on the new weights while one whose finish failed stays on the old, where
    separate calls keep every server paused until the round's failure rule decides."""
    servers = named_servers(client)
    one = servers is None or len(servers) == 1
    return one and caps.finishes_with_resume and client.finishes_with_resume() is True


def finishes_with_reset(client: Any, caps: ClientCaps) -> bool:
    """Every server advertised the finish that also resets its caches
    (``routes.FINISH_RESETS_RESUMES``): an unpaused round asks for the resets in its finish.
    Several servers too: a server whose finish failed reset nothing and keeps serving the
    weights its caches were made with (only the resume is kept apart, ``finishes_with_resume``)."""
    return caps.finishes_with_resume and client.finishes_with_resume() is True


def _check_reset(version: str, answers: Sequence[object]) -> None:
    """Each server's answer to a finish with the reset folded in: ``True`` once it reset."""
    refused = [i for i, ok in enumerate(answers) if ok is not True]
    if refused:
        raise StaleCacheError(
            version,
            f"server(s) {', '.join(map(str, refused))} did not say they reset their caches "
            "with the finish",
        )


def commit_reset(client: Any, version: str, *, record: Callable[[], None]) -> None:
    """An unpaused round's finish and, once it committed, the caches reset, in one request per
    server (the reset right after the commit, as in line, with no round trip between). A
    failed finish fails the round; a server that did not say it reset: ``StaleCacheError``."""
    answers = client.finish_reset_resume(version, resume=False)
    record()
    _check_reset(version, answers)


def commit_resumed(client: Any, version: str, *, record: Callable[[], None]) -> None:
    """One request per server: finish, then (once committed) the caches reset, then resume.

    A failed finish fails the round (that server reset and resumed nothing; the pause's own
    rule applies, as with separate calls); a resume a server refused after its commit raises
    once the round is recorded, as a failed ``/resume`` would."""
    try:
        answers = client.finish_reset_resume(version)
    except WeightSyncError as exc:
        if exc.route == "resume":  # every finish committed; a server would not resume
            record()
        raise
    record()
    _check_reset(version, answers)


class FinishInUpdate:
    """A round's finish carried by its update POST (``routes.UPDATE_FINISHES``: the reference
    server commits right after the update succeeded, then resets / resumes as the finish's
    flags ask): a round is its start and its update. ``post`` is the round's update POST
    (``paused``: asked when it goes, whether the round is paused as a whole, so the server
    resumes it); ``committed`` is the round's commit step once that POST returned.

    Only for one server (``finish_in_update``): with several, one server would commit while
    another's update failed. A failed update commits nothing; a failed commit raises for
    ``finish_weight_update`` from the update POST (the round failed after its bytes: the
    engine needs a new init, as the server's session does)."""

    def __init__(
        self, client: Any, version: str, *, reset: bool, paused: Callable[[], bool]
    ) -> None:
        self._client, self._version, self._reset, self._paused = client, version, reset, paused
        self.posted = False
        """The update POST carried the finish and returned: the round committed."""
        self._resume = False
        self._replies: list[dict[str, Any]] = []
        self.starts: str | None = None
        """The round's start rides on the update too, pausing in this mode
        (``start_in_update``): the whole round is one request."""

    def start_in_update(self, mode: str) -> None:
        """The update POST also carries the round's start, which pauses (``mode``) before its
        workers start (``routes.UPDATE_STARTS``; ``early.one_request`` says where)."""
        self.starts = mode

    def post(self, payload: dict[str, Any]) -> None:
        self._resume = self._paused()
        if self.starts is not None:
            self._replies = self._client.start_update_finish(
                payload,
                self._version,
                pause=self.starts,
                reset_caches=self._reset,
                resume=self._resume,
            )
        else:
            self._replies = self._client.update_and_finish(
                payload, self._version, reset_caches=self._reset, resume=self._resume
            )
        self.posted = True

    def committed(self, record: Callable[[], None]) -> bool:
        """The commit step of a round whose update committed it: ``record()``, then the
        resume and the resets as ``commit_resumed`` / ``commit_reset`` check them. Returns
        whether the server resumed itself."""
        record()
        servers = named_servers(self._client) or ["the server"]
        refused = refused_resume(self._replies, servers, "update") if self._resume else None
        if refused is not None:
            raise refused
        if self._reset:
            _check_reset(self._version, [r.get("caches_reset") is True for r in self._replies])
        return self._resume


def finish_in_update(
    client: Any,
    caps: ClientCaps,
    version: str,
    *,
    reset: bool,
    paused: Callable[[], bool],
    single: bool,
) -> FinishInUpdate | None:
    """The round's finish in its update POST (``FinishInUpdate``), where the client drives
    one server that advertised it and the round is ``single``: one update POST, committed as
    soon as it landed (no overlapped round's last-moment stop). Else None: a separate finish."""
    servers = named_servers(client)
    if not (single and servers is not None and len(servers) == 1):
        return None
    if not (caps.updates_with_finish and client.updates_with_finish() is True):
        return None
    return FinishInUpdate(client, version, reset=reset, paused=paused)


_WAIT_GRACE_S = 30.0
"""How much longer than the client's own per-call timeout the commit waits for its calls:
the client's timeout decides (as it does for a call made in line); this only guards a
client that has none."""


def commit_paused(
    client: EngineClient,
    version: str,
    *,
    caps: ClientCaps,
    record: Callable[[], None],
    timeout: float,
) -> None:
    """A round paused as a whole: the finish and both resets at once, each awaited (bounded).

    A failed finish fails the round as it would in line; the resets that ran beside it are
    harmless then (they only dropped caches of the weights still served, under the pause).
    A finish that held with a reset that did not: ``StaleCacheError`` (committed), as in line.
    """
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("finish_weight_update", lambda: client.finish_weight_update(version)),
        ("reset_prefix_cache", lambda: reset_prefix(client, version)),
    ]
    if caps.reset_encoder_cache:
        encoder = client.reset_encoder_cache
        calls.append(("reset_encoder_cache", lambda: reset_encoder(encoder, version)))
    futures = [spawn(call, name=f"weightwire-{what}") for what, call in calls]
    # Every call is awaited, whatever the finish said: the caller resumes (or gives up) only
    # once none of them is still on its way to a server.
    bound = timeout + _WAIT_GRACE_S
    deadline = time.monotonic() + bound
    finish, *resets = [
        _outcome(f, what, deadline, bound) for f, (what, _) in zip(futures, calls, strict=True)
    ]
    if finish is not None:
        raise finish
    record()
    for exc in resets:
        if isinstance(exc, StaleCacheError):
            raise exc
        if exc is not None:  # a reset that never answered: committed all the same
            raise StaleCacheError(version, str(exc)) from exc


def _outcome(future: Future[Any], what: str, deadline: float, bound: float) -> BaseException | None:
    """The call's error (``ControlTimeout`` if it did not return by ``deadline``), or None."""
    try:
        future.result(timeout=max(0.0, deadline - time.monotonic()))
    except FutureTimeout:
        if not future.done():
            return ControlTimeout(f"{what} did not return within {bound:g} s", route=what)
        return future.exception()
    except BaseException as exc:
        return exc
    return None


def commit_plan(
    info: TrainerInitInfo, client: object, caps: ClientCaps, round_pause: str | None
) -> CommitPlan:
    """The plan for this engine; ``round_pause`` is the mode the whole round is
    paused in (or None)."""
    if not info.reset_prefix_cache:
        logger.info(
            "reset_prefix_cache=False: vLLM may answer requests from KV computed before a round"
        )
        return CommitPlan(reset=False)
    if round_pause is not None:
        return CommitPlan(reset=True)
    if info.pause_mode == "auto" and caps.can_pause:
        return CommitPlan(
            reset=True
        )  # a staging plugin backend: unpaused by design (the module docstring)
    why = (
        "pause_mode=None"
        if info.pause_mode is None
        else f"client {type(client).__name__} cannot pause"
    )
    logger.warning(
        "%s: the cache reset after each round runs unpaused; a request scheduled between the "
        "commit and the reset may reuse KV computed with the previous weights",
        why,
    )
    return CommitPlan(reset=True)


def reset_after_commit(client: EngineClient, version: str, caps: ClientCaps) -> None:
    """Every server's prefix cache (running requests preempted) and encoder cache, dropped.

    ``client.reset_prefix_cache()`` returns one ``success`` per server (or nothing: a
    client that raised nothing is taken at its word); ``reset_encoder_cache`` is called
    when the client has it."""
    reset_prefix(client, version)
    if caps.reset_encoder_cache:
        reset_encoder(client.reset_encoder_cache, version)


def reset_prefix(client: EngineClient, version: str) -> None:
    """Every server's prefix cache, retried while one answers ``success: false``."""
    for attempt in range(1, _RESET_ATTEMPTS + 1):
        try:
            answers = client.reset_prefix_cache()
        except WeightSyncError as exc:
            hint = (
                (
                    " (the server has no /reset_prefix_cache route; vLLM serves it with "
                    "VLLM_SERVER_DEV_MODE=1, as it does the weight routes)"
                )
                if exc.status == 404
                else ""
            )
            raise StaleCacheError(version, f"{exc}{hint}") from exc
        except Exception as exc:
            raise StaleCacheError(
                version, f"reset_prefix_cache raised {type(exc).__name__}: {exc}"
            ) from exc
        refused = [] if answers is None else [i for i, ok in enumerate(answers) if ok is not True]
        if not refused:
            break
        if attempt == _RESET_ATTEMPTS:
            raise StaleCacheError(
                version,
                f"server(s) {', '.join(map(str, refused))} answered success=false to "
                f"/reset_prefix_cache {_RESET_ATTEMPTS} times (KV still held, e.g. by "
                "a KV connector's transfer in flight)",
            )
        time.sleep(_RESET_RETRY_S * attempt)


def reset_encoder(encoder: Callable[[], Any], version: str) -> None:
    """``reset_encoder_cache`` (the client's bound method); a failure is a ``StaleCacheError``."""
    try:
        encoder()
    except Exception as exc:
        raise StaleCacheError(
            version,
            f"reset_encoder_cache failed ({exc}): a multimodal model's cached "
            "encoder outputs may come from the previous weights",
        ) from exc
