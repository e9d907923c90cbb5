"""The two steps where a control-plane POST runs beside the data plane, and their failure rules.

- ``join_beside_init``: rank 0 joins the backend's rendezvous while the worker init info
  is POSTed on a side thread (the workers join from inside that request).
- ``Transfer.run``: a round's broadcasts, with ``start_weight_update`` folded in after
  the first chunk is prepared and the ``update_weights`` POST on a side thread
  *concurrently with* the broadcasts (workers receive inside that request).

Failure rules, each preventing a hang or a misleading error: a failed update POST
aborts the communicator so a broadcast blocked on a worker that gave up returns at
once; a side thread is never joined on an error path; when the data plane failed
only because the server rejected the call, the server's error is raised (it names
the real cause, ``real_cause``), not the secondary transfer error; every wait on a
POST has a timeout (``await_call``). A round that failed after its first broadcast
leaves the communicator aborted (``Transfer.broken``): the engine refuses further rounds.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from weightwire._trace import trace
from weightwire.backends.base import Outgoing, Prepared, RoundSender, Sent
from weightwire.control.fanout import spawn
from weightwire.control.request_path import on_sent
from weightwire.shared.client import EngineClient
from weightwire.shared.errors import (
    ControlTimeout,
    TransferError,
    TransferTimeout,
    WeightSyncError,
)
from weightwire.shared.framing import Chunk
from weightwire.shared.meta import ParamMeta
from weightwire.shared.routes import start_left_paused
from weightwire.shared.source import WeightSource
from weightwire.trainer.handoff import quick_handoffs
from weightwire.trainer.metrics import PhaseClock

logger = logging.getLogger(__name__)

_GRACE_S = 2.0
"""How long a failed data plane waits for the server's verdict before raising its own
(a worker that failed answers its request within milliseconds)."""
_SENT_BOUND_S = 0.005
"""How long the data path lets the round's one request be written (``Transfer._send_one``):
it leaves in tenths of a millisecond; the bound only keeps a slow one from holding it up."""

_SETTLE_POLL_S = 0.05

_VLLM_UPDATE_ACTIVE = "Cannot release a trainer connection during a weight update"
"""Stock vLLM's worker refusing a shutdown while its update is active (a 500): its 409
"a weight update is active", retried the same way (the update's failure clears it)."""


def await_call(future: Future, timeout: float, what: str) -> Any:
    """The POST's answer (or its own error); ``ControlTimeout`` naming ``what`` if
    none came in time."""
    try:
        return future.result(timeout=timeout)
    except FutureTimeout:
        if future.done():  # the call itself raised a TimeoutError: that is its answer
            raise
        raise ControlTimeout(
            f"{what} did not return within {timeout} s", route=what.split()[0]
        ) from None


def real_cause(exc: BaseException, post: Future) -> BaseException:
    """The server's error when the data plane failed because the server gave up.

    A transfer error right after a rejected POST is a consequence; the POST's answer
    (route, status, server message) says why. Waits briefly for that answer.
    """
    if isinstance(exc, TransferError):
        try:
            post.exception(timeout=_GRACE_S)
        except FutureTimeout:
            return exc
    if post.done() and post.exception() is not None and isinstance(exc, TransferError):
        cause = post.exception()
        assert cause is not None
        cause.add_note(f"the data plane then failed: {type(exc).__name__}: {exc}")
        return cause
    return exc


# -- init ----------------------------------------------------------------------------------


def beside_init(post: Future, link: Any, step: Callable[[], Any]) -> Any:
    """``step`` on the joined link while the init POST may still be in flight (a worker that
    tells its wants on the data plane answers its init only after): a POST that fails
    meanwhile aborts the link, so the step ends at once, and the POST's error is raised."""
    waiting = threading.Event()
    waiting.set()

    def on_done(f: Future) -> None:
        if waiting.is_set() and f.exception() is not None:
            link.abort()  # no worker will send: end the step's wait now, not at its timeout

    post.add_done_callback(on_done)
    try:
        return step()
    except BaseException as exc:
        raise real_cause(exc, post) from None
    finally:
        waiting.clear()


def join_beside_init(
    rdv: Any, post_init: Callable[[], Any], *, connect_s: float, what: str
) -> tuple[Any, Future]:
    """Join ``rdv`` while ``post_init`` runs on a side thread; returns ``(comm, post)``.

    Waits for the join unless the POST fails first (the server refused the init info:
    no worker will ever arrive; its error is raised). A POST that succeeds first is not
    an end. A join that is still pending when this gives up is aborted if it lands later.
    """
    post = spawn(post_init, name="weightwire-init")
    post.add_done_callback(lambda f: rdv.cancel() if f.exception() is not None else None)
    join = spawn(lambda: rdv.join(timeout=connect_s), name="weightwire-join")
    deadline = time.monotonic() + connect_s + _GRACE_S
    while not join.done() and not (post.done() and post.exception() is not None):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        wait(
            [join] if post.done() else [post, join], timeout=remaining, return_when=FIRST_COMPLETED
        )
    if not join.done() and post.done() and post.exception() is not None:
        join.add_done_callback(_abort_late)  # rank 0 may still join later; release it then
        raise post.exception()  # type: ignore[misc]
    if not join.done():
        join.add_done_callback(_abort_late)
        rdv.cancel()
        raise TransferTimeout(f"rank 0 rendezvous ({what}) did not complete within {connect_s} s")
    try:
        return join.result(), post
    except BaseException as exc:
        raise real_cause(exc, post) from None


def _abort_late(join: Future) -> None:
    if join.exception() is None:
        join.result().abort()


# -- a round -------------------------------------------------------------------------------


class Transfer:
    """One round's data plane with the control plane folded in.

    The pipeline prepares the first chunk, then calls ``begin``: ``control`` (pause +
    start, booked as the ``control`` phase), then the update POST on a side thread;
    only then does the first byte go out, so the first chunk's packing overlaps the
    start round trip (``go_accepts``: a data path may write once the workers said from
    inside their start that they are in the round, ``Outgoing.go_accepts``). A failure
    before ``begin`` finished sent nothing, unless the data path wrote at the go: the
    pipeline is settled and ``broken`` stays ``None`` (the engine stays usable). After it,
    or after a write at the go, ``broken`` is the error the engine must refuse further
    rounds with.
    """

    def __init__(
        self,
        comm: Any,
        pipeline: RoundSender,
        *,
        post_update: Callable[[], Any],
        control: Callable[[], None],
        clock: PhaseClock,
        http_s: float,
        go_accepts: bool = False,
        ready: Callable[[], None] | None = None,
        finishes: bool = False,
        one_request: bool = False,
        failed: Callable[[BaseException], None] | None = None,
    ) -> None:
        """``finishes``: the update POST carries the round's finish (``freshness.FinishInUpdate``),
        so its wait after the last broadcast includes the servers' commit (named so when it
        times out). ``one_request``: it carries the start too (``Outgoing.one_request``; only
        over a data path that ``hears_workers``): ``begin`` runs ``control`` (nothing sent),
        sends the request and returns once the data path heard every worker's word.
        ``failed`` is told the round's error as soon as it is caught, before the waits of its
        failure rules (``snapshot.FailedFirst``: a shutdown meanwhile did not cause it)."""
        self._failed = failed
        self._comm = comm
        self._finishes = finishes
        self._one_request = one_request
        self._heard = threading.Event()  # every worker spoke from inside the request
        self._sent = threading.Event()  # the request's bytes were written
        self._answered = threading.Event()  # the request answered, or the workers spoke
        self._go_accepts = go_accepts
        self._ready = ready
        self._pipeline = pipeline
        self._post_update = post_update
        self._control = control
        self._clock = clock
        self._http_s = http_s
        self._stop = threading.Event()
        self._update: Future | None = None
        self.broken: BaseException | None = None

    def run(self, prepared: Iterable[Prepared], wire_metas: Sequence[ParamMeta]) -> Sent:
        """Broadcast ``prepared``; returns ``(bytes, broadcasts)`` once the update POST answered.
        The control plane's threads get the GIL back quickly meanwhile (``handoff``)."""
        with quick_handoffs():
            return self._run(prepared, wire_metas)

    def _run(self, prepared: Iterable[Prepared], wire_metas: Sequence[ParamMeta]) -> Sent:
        pipeline, stop = self._pipeline, self._stop
        out = Outgoing(
            prepared,
            stop,
            self._begin_one if self._one_request else self._begin,
            metas=wire_metas,
            go_accepts=self._go_accepts,
            ready=self._ready,
            request=self._send_one if self._one_request else None,
            one_request=self._one_request,
            heard=self._on_heard if self._one_request else None,
        )
        try:
            sent = pipeline.send(out)
            assert self._update is not None
            what = "update_weights (after the last broadcast)"
            if self._one_request:
                what = "update_weights (after the last broadcast; it carries the round's start "
                what += "and finish: the servers' commit runs in it)"
            elif self._finishes:  # a commit held up (the model lock) is what a user should see
                what = "update_weights (after the last broadcast; it carries the round's finish: "
                what += "the servers' commit runs in it)"
            await_call(self._update, self._http_s, what)
            trace("answered")
            return sent
        except BaseException as exc:
            stop.set()
            if self._failed is not None:
                self._failed(exc)
            if self._one_request and self._update is not None and not self._heard.is_set():
                cause = self._unheard(exc)
                if cause is exc:
                    raise
                raise cause from None
            if self._update is None and out.wrote_early.is_set():
                # Written at the workers' go, then the start failed: the workers hold part
                # of a round their server gave up (it refuses generation until a whole
                # round commits), as after a failed first byte.
                exc.add_note(
                    "the round was being written into the workers' parameters (their start "
                    "had accepted it): they refuse generation until a whole round commits"
                )
                self.broken = exc
                self._comm.abort()
                raise
            if (
                self._update is None
            ):  # nothing went on the wire: settle the local work, keep the engine
                try:
                    pipeline.settle()
                except BaseException as settle_exc:
                    self.broken = settle_exc
                    self._comm.abort()
                raise
            self.broken = exc
            self._comm.abort()
            cause = real_cause(exc, self._update)
            if cause is exc:
                if not isinstance(exc, TransferError):  # real_cause waited for it already
                    _await_verdict(self._update)
                raise
            self.broken = cause
            raise cause from None

    def _begin(self) -> None:
        started = time.perf_counter()
        try:
            self._control()
        finally:
            self._clock.shift("transfer", "control", time.perf_counter() - started)
        future = spawn(self._post_update, name="weightwire-update")
        # Not a bound method: a done future keeps its callbacks, and one holding this
        # Transfer would make a cycle (the future is ``_update``) that keeps the whole
        # round (its payload, patches, control) for the garbage collector (#49).
        stop, comm = self._stop, self._comm
        future.add_done_callback(lambda f: _on_update_done(f, stop, comm))
        self._update = future

    def _send_one(self) -> None:
        """The round's one request out, once (the data path calls it from its own thread as
        its pump starts, ``Outgoing.request``; else ``begin`` does): ``control`` (it sends
        nothing: it records the request as the round's pause and start), then the request on a
        helper thread. Returns once the request's bytes were written (at most
        ``_SENT_BOUND_S``): meanwhile the helper has the interpreter to itself to build and
        write them, where the data path's next work (its first chunk's regions and copies,
        Python that overlaps the server's work) would have slowed it at every switch."""
        if self._update is not None:
            return
        started = time.perf_counter()
        trace("one>")
        try:
            self._control()
            trace("control<")
            post, sent = self._post_update, self._sent

            def posted() -> Any:
                trace("post>")
                try:
                    with on_sent(sent.set):
                        answer = post()
                    trace("post<")
                    return answer
                finally:
                    sent.set()  # refused before its bytes left, or another transport

            future = spawn(posted, name="weightwire-round")
            stop, comm, heard, answered = self._stop, self._comm, self._heard, self._answered

            def done(f: Future) -> None:  # not a bound method: no cycle through the future
                trace("post done")
                answered.set()
                if f.exception() is not None:
                    stop.set()
                    if heard.is_set():  # the workers are in the round: stop them now
                        comm.abort()

            future.add_done_callback(done)
            self._update = future
            trace("spawned")
            sent.wait(_SENT_BOUND_S)
            trace("sent seen")
        finally:
            self._clock.shift("transfer", "control", time.perf_counter() - started)

    def _begin_one(self) -> None:
        """The round in one request: the request (``_send_one``, where the data path has not
        sent it); returns once the data path heard every worker's word from inside it (then the
        request's failure is one after the go: the link is aborted, as after a first byte), or
        raises the request's own error when it failed before that (a start its server refused:
        nothing written)."""
        self._send_one()
        started = time.perf_counter()
        update, heard, answered = self._update, self._heard, self._answered
        assert update is not None
        try:
            if not answered.wait(self._http_s + _GRACE_S):
                raise ControlTimeout(
                    f"update_weights (it carries the round's start) neither answered nor let "
                    f"the workers speak on the data path within {self._http_s:g} s",
                    route="update_weights",
                )
            if not heard.is_set():
                update.result()  # its error: refused before any worker spoke
        finally:
            self._clock.shift("transfer", "control", time.perf_counter() - started)

    def _on_heard(self) -> None:
        self._heard.set()
        self._answered.set()

    def _unheard(self, exc: BaseException) -> BaseException:
        """A round of one request failed before the data path heard any worker's word: the
        trainer wrote nothing. Where the request itself failed the local work is settled; the
        engine is kept where its server says the start opened no round
        (``start_opened_nothing``), as after a refused start, and needs a new init where the
        server failed the round past that (it ended the session); else (the trainer's own failure
        with the request still out) the servers may open a round that gets no byte: the link
        is aborted (the workers see it close) and the engine needs a new init. Returns the
        error to raise (the request's own where it failed)."""
        update = self._update
        assert update is not None
        cause = update.exception() if update.done() else None
        if cause is not None:
            try:
                self._pipeline.settle()
            except BaseException as settle_exc:
                self.broken = settle_exc
                self._comm.abort()
            if cause is not exc:
                cause.add_note(f"the data path then stopped: {type(exc).__name__}: {exc}")
            if not start_opened_nothing(cause) and self.broken is None:
                # Past the start's checks its server opened the round, and failing it there
                # ended the session (a worker refusing a delta round's base at its update,
                # before its word): kept, the engine's next round would be refused by a
                # server that no longer knows it, and a delta round's dense retry with it.
                self.broken = cause
                self._comm.abort()
            return cause
        exc.add_note(
            "the round's one request (start, update, finish) was out: its servers may have "
            "opened a round that gets no byte; the data link was closed"
        )
        self.broken = exc
        self._comm.abort()
        return exc


def start_refused(exc: BaseException) -> bool:
    """``exc`` is a start its server refused by its own checks (a 4xx answer for
    ``start_weight_update``): that server paused nothing and started no worker."""
    return (
        isinstance(exc, WeightSyncError)
        and exc.route == "start_weight_update"
        and exc.status is not None
        and 400 <= exc.status < 500
    )


def start_opened_nothing(exc: BaseException) -> bool:
    """``exc`` is a start (its own call, or riding on an update) that its server says opened
    no round: refused by its checks (``start_refused``), or failed at its own pause before any
    worker's start (a ``wait`` pause that did not drain: its error body says what became of
    that pause, ``WeightSyncError.pause``; only a start that started no worker says it)."""
    return start_refused(exc) or (
        isinstance(exc, WeightSyncError)
        and exc.route == "start_weight_update"
        and start_left_paused(exc.pause) is not None
    )


def _await_verdict(update: Future) -> None:
    """After the trainer's own failure mid-round (the link aborted), the update POST's answer,
    for at most ``_GRACE_S``: its workers fail the round at once on the closed link, so the
    servers have ended the round before the caller's next call (a stock vLLM refuses the
    shutdown that usually follows with a 500 while its worker's update is active, and its
    update POST may still be on its way when this raises)."""
    with contextlib.suppress(FutureTimeout):
        update.exception(timeout=_GRACE_S)


def _on_update_done(future: Future, stop: threading.Event, comm: Any) -> None:
    if future.exception() is not None:
        # The workers gave up on this round: nothing will ever receive the
        # pending broadcast, so unblock it now instead of at its timeout.
        stop.set()
        comm.abort()


def chunked(pairs: Iterable[tuple[str, Any]], chunks: Sequence[Chunk]) -> Iterator[Prepared]:
    """Group a checked ``(name, tensor)`` stream by the round's plan.

    After the last chunk the stream is pulled once more, so ``checked_iter``'s end
    check (an extra or a missing tensor) fires before the round is declared done.
    """
    it = iter(pairs)
    for chunk in chunks:
        tensors = [tensor for _, tensor in itertools.islice(it, len(chunk))]
        yield chunk, tensors
    next(it, None)


def tensor_stream(source: WeightSource) -> Iterator[tuple[str, Any]]:
    """The round's ``(name, tensor)`` stream. A source that overrides ``iter_groups``
    (``PytreeSource``: one jitted call per layer group) is driven per group, so a
    per-expert MoE costs one device dispatch per layer instead of one per tensor; any
    other source is iterated as is (the default grouping would only buffer a layer)."""
    if type(source).iter_groups is WeightSource.iter_groups:
        return iter(source)
    return (pair for group in source.iter_groups() for pair in group)


def tap(
    pairs: Iterable[tuple[str, Any]], digests: dict[str, str], sha: Callable[[Any], str]
) -> Iterator[tuple[str, Any]]:
    """``pairs`` unchanged, recording each tensor's digest for the round's verify step."""
    for name, tensor in pairs:
        digests[name] = sha(tensor)
        yield name, tensor


# -- around a round ------------------------------------------------------------------------


def settle_bound(transfer_s: float) -> float:
    """How long a server may take to fail a round its trainer abandoned: one broadcast
    timeout (its worker's receive) or its round lease (the same bound), twice, plus slack."""
    return 2 * transfer_s + _GRACE_S


class SettleWatch:
    """The shutdown poll (``shutdown_when_settled``) as its waiter sees it at the bound:
    ``halt`` stops it and says whether a call is out. With none out the poll raises at once,
    naming the server's last answer, whatever the machine's speed (a waiter that raised
    its own bare timeout instead lost that answer whenever the poll thread had not run yet)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self._calling = False

    def begin_call(self) -> bool:
        """A call may start: ``False`` once halted (the poll then raises, not calls)."""
        with self._lock:
            self._calling = not self.stop.is_set()
            return self._calling

    def end_call(self) -> None:
        with self._lock:
            self._calling = False

    def halt(self) -> bool:
        """No call starts from now on; ``True`` if one is out (its answer is not waited for)."""
        with self._lock:
            self.stop.set()
            return self._calling


def shutdown_when_settled(
    client: EngineClient,
    transfer_s: float,
    *,
    deadline: float | None = None,
    watch: SettleWatch | None = None,
) -> None:
    """``shutdown_weight_transfer_engine``, retried while the server answers 409 because it
    has not yet failed the round this trainer just abandoned.

    No attempt starts after ``deadline`` (``time.monotonic()``; default ``settle_bound``
    from now), nor once ``watch`` is halted (its caller stopped waiting: a poll left behind
    ends at once instead of calling on). Either way a server still in its round raises
    ``ControlTimeout`` naming the route and the server's last answer."""
    started = time.monotonic()
    if deadline is None:
        deadline = started + settle_bound(transfer_s)
    watch = SettleWatch() if watch is None else watch
    message = ""
    while True:
        if not watch.begin_call():
            if not message:  # halted before its first call went out
                raise ControlTimeout(
                    "shutdown_weight_transfer_engine was not sent: its caller stopped waiting "
                    "first",
                    route="shutdown_weight_transfer_engine",
                )
            raise _still_active(time.monotonic() - started, message)
        try:
            client.shutdown_weight_transfer_engine()
            return
        except Exception as exc:
            message = str(getattr(exc, "message", exc))
            status = getattr(exc, "status", None)
            settling = (
                status == 409
                and (
                    "a weight update is active" in message or "another weight operation" in message
                )
            ) or (status == 500 and _VLLM_UPDATE_ACTIVE in message)
            if not settling:
                raise
            if watch.stop.is_set() or time.monotonic() + _SETTLE_POLL_S >= deadline:
                raise _still_active(time.monotonic() - started, message) from exc
        finally:
            watch.end_call()
        if watch.stop.wait(_SETTLE_POLL_S):
            raise _still_active(time.monotonic() - started, message)


def _still_active(waited: float, answer: str) -> ControlTimeout:
    return ControlTimeout(
        f"shutdown_weight_transfer_engine: the server still had a round active after {waited:.1f} "
        f"s of retries (its last answer, 409: {answer}); a server fails a round its trainer "
        "abandoned within its broadcast timeout or round lease (2 x Timeouts.transfer_s): "
        "look at the server's log for the round that stays open, or restart it",
        route="shutdown_weight_transfer_engine",
    )


def best_effort_resume(client: Any) -> None:
    """``client.resume()`` on a failure path: the round's own error is what the caller
    must see, so a resume failure is logged, not raised."""
    try:
        client.resume()
    except Exception as exc:
        logger.warning("resume after a failed round also failed: %s", exc)
