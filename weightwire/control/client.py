"""``HTTPWeightSyncClient``: vLLM's weight-sync HTTP routes, driven over httpx.

The plumbing under the routes is ``servers.ServerSet``, and the serving-state routes (pause,
caches, sleep, weight info and checksums, the round guard, version) come from
``serving.ServingRoutes`` beneath this class. Each call is built and sent by
``request_path.RequestPath`` (httpx requests and responses, httpx's exceptions, a leaner path
to the socket than ``httpx.Client.request``: a round's three calls are its fixed cost; see
``request_path``).

It satisfies the four-call client protocol trainer engines use
(``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update``) and adds the routes a sync needs around them (world size,
version, pause/resume, weight info and checksums, shutdown).

Several base URLs (independent DP replicas) are driven as one: every call reaches
every server concurrently and returns once all answered, so no replica is left on
stale weights; the first failure is raised at once (see ``fanout.fan_out``). Any
non-2xx answer raises ``WeightSyncError`` carrying the route, status, server message
and base URL. The API key, when given, travels as a bearer token and never appears
in reprs, logs or errors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import httpx

from weightwire.control.dp import RankLayout, ServerTopology, plan_ranks
from weightwire.control.ready import wait_until_ready
from weightwire.control.serving import ServingRoutes
from weightwire.shared import routes
from weightwire.shared.errors import ConfigError, WeightSyncError, WrongType
from weightwire.shared.routes import PAUSE_MODES, SERVED_MODEL, SERVED_MODEL_METHOD
from weightwire.shared.served import ServedModel, from_worker_answers


class NotAdvertised(ConfigError, RuntimeError):
    """A call that needs a feature every server names in its init reply (``pause_and_start``:
    ``START_PAUSES``, ...), made where a server did not name it (stock vLLM never does) or
    before any init; the message names those servers and the calls to use instead. Nothing
    was sent.

    Also a ``RuntimeError``, which such a call raised before it had a class of its own.
    """


class HTTPWeightSyncClient(ServingRoutes):
    """Drive one or more vLLM servers' weight-sync routes.

    ``base_url``: one server's base URL or a list (DP replicas); a bare ``host:port`` means
    ``http://host:port``; anything else raises ``ConfigError``. ``timeout`` bounds every single
    HTTP call (init and update block while the workers rendezvous and receive, so it must cover
    a whole transfer). ``ready_timeout`` (seconds): first wait until every server answers
    ``GET /health`` (``wait_until_ready``; ``ServerNotReady`` when it expires), for a trainer
    started beside a server that is still loading; ``None`` (the default) waits for nothing.
    ``transport`` is for tests (``httpx.MockTransport``).
    """

    def __init__(
        self,
        base_url: str | Sequence[str],
        *,
        timeout: float = 300,
        api_key: str | None = None,
        ready_timeout: float | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        super().__init__(base_url, timeout=timeout, api_key=api_key, transport=transport)
        if ready_timeout is not None:
            try:
                wait_until_ready(self.base_urls, ready_timeout, api_key=api_key)
            except BaseException:
                self.close()
                raise
        self._layout: RankLayout | None = None
        self._servers: list[ServerTopology] = []
        self._features: list[frozenset[str]] = [frozenset()] * len(self._clients)
        """Per server: the features its last init reply named (``routes.FINISH_RESETS_RESUMES``)."""
        self._inited = False
        """The last init succeeded on every server (its features are told)."""
        self._version_features: list[frozenset[str]] | None = None
        """Per server: the features its ``/version`` reply named (asked only before an init,
        by a pause or sleep that waits); None: not asked."""
        self._served: list[Any] = [None] * len(self._clients)
        """Per server: the ``served_model`` its last init reply carried (raw JSON), if any."""
        self._wait_cap_s = math.inf
        """The longest a caller waits for one of this client's calls (``bound_waits``)."""

    def __repr__(self) -> str:
        return f"HTTPWeightSyncClient({self.base_urls!r}, timeout={self.timeout})"

    # -- the four-call protocol ---------------------------------------------------------

    def init_weight_transfer_engine(
        self, init_info: dict[str, Any] | Sequence[dict[str, Any]]
    ) -> None:
        """POST the worker init info to every server.

        With several servers, each one's workers need their own ``rank_offset``: a
        single dict carrying ``rank_offset`` is shifted by the world sizes of the
        servers before it (from ``get_world_size``), so callers write the payload once.
        A list gives each server its own dict verbatim.
        """
        if isinstance(init_info, dict):
            bodies = [{"init_info": info} for info in self._per_server_init(init_info)]
        else:
            infos = list(init_info)
            if len(infos) != len(self._clients):
                raise ConfigError(f"got {len(infos)} init infos for {len(self._clients)} servers")
            bodies = [{"init_info": info} for info in infos]
        self._sessions = [None] * len(self._clients)  # a failed init leaves no session to claim
        self._features = [frozenset()] * len(self._clients)
        self._inited = False
        self._served = [None] * len(self._clients)
        replies = self._all(routes.INIT, bodies=bodies)
        # A server that owns sessions returns an id; later weight calls prove with it that
        # they come from this session, so a newer trainer's init makes them fail fast.
        self._sessions = [
            r.get("session_id")
            if isinstance(r, dict) and isinstance(r.get("session_id"), str)
            else None
            for r in replies
        ]
        self._features = [_features(r) for r in replies]
        self._inited = True
        self._served = [
            r.get(SERVED_MODEL) if SERVED_MODEL in f and isinstance(r, dict) else None
            for r, f in zip(replies, self._features, strict=True)
        ]

    def served_model(self) -> ServedModel | None:
        """The tensors the served model takes, as every server's last init reply told them
        (``shared.served``); ``None`` when a server told none (stock vLLM's routes do not).
        ``WeightSyncError`` for a malformed one, or servers that serve different models."""
        if not self._served or any(raw is None for raw in self._served):
            return None
        models = []
        for url, raw in zip(self.base_urls, self._served, strict=True):
            try:
                models.append(ServedModel.from_dict(raw, f"{url}'s init reply served_model"))
            except ValueError as exc:
                raise WeightSyncError(routes.INIT.name, 200, str(exc), url) from None
        return self._one_model(
            models, routes.INIT.name, " (their init replies name different tensors)"
        )

    def workers_served_model(self) -> ServedModel | None:
        """The served model as the servers' workers tell it (the weightwire vLLM plugin's
        worker method, through vLLM's dev route ``POST /collective_rpc``), for servers whose
        init reply tells nothing; ``None`` where a server has no such route or a worker
        cannot tell. ``WeightSyncError`` for a malformed answer or servers that disagree."""
        body = {"method": SERVED_MODEL_METHOD, "timeout": self.timeout}
        try:
            replies = self._all(routes.COLLECTIVE_RPC, body)
        except WeightSyncError as exc:
            if exc.status is not None and 400 <= exc.status < 500:
                return None  # no dev route, or no such worker method: nothing told
            raise
        models = []
        for url, reply in zip(self.base_urls, replies, strict=True):
            results = reply.get("results") if isinstance(reply, dict) else None
            try:
                model = from_worker_answers(results, f"{url} /collective_rpc")
            except ValueError as exc:
                raise WeightSyncError(routes.COLLECTIVE_RPC.name, 200, str(exc), url) from None
            if model is None:
                return None
            models.append(model)
        return self._one_model(models, routes.COLLECTIVE_RPC.name)

    def _one_model(self, models: list[ServedModel], route: str, why: str = "") -> ServedModel:
        """The model every server serves (``models``: one per base URL, as ``route`` told);
        ``WeightSyncError`` naming the first server that serves another."""
        for url, model in zip(self.base_urls[1:], models[1:], strict=True):
            if model != models[0]:
                raise WeightSyncError(
                    route,
                    200,
                    f"serves another model than {self.base_urls[0]}{why}; one trainer's rounds "
                    "fit one model",
                    url,
                )
        return models[0]

    def start_weight_update(self) -> None:
        self._all(routes.START)

    def start_draft_weight_update(self) -> None:
        """Open a round that loads into the speculative draft model (update/finish unchanged)."""
        self._all(routes.START_DRAFT)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        """POST one round's update info; returns once every worker received and loaded."""
        self._all(routes.UPDATE, {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        if weight_version is not None and not isinstance(weight_version, str):
            raise WrongType(f"weight_version must be a str, got {type(weight_version).__name__}")
        self._all(
            routes.FINISH, None if weight_version is None else {"weight_version": weight_version}
        )

    def starts_with_pause(self) -> bool:
        """Every server's init reply named ``START_PAUSES`` (the reference server; never stock
        vLLM): ``pause_and_start`` may be used."""
        return all(routes.START_PAUSES in f for f in self._features)

    def bounds_pause_waits(self) -> bool:
        """Every server named ``PAUSE_BOUNDS`` (the reference server; never stock vLLM): in
        its last init reply, or, before any init, in its ``/version`` reply (asked by the
        first pause or sleep that waits): a pause that waits carries ``wait_s``."""
        told = self._features if self._inited else self._version_features
        return told is not None and all(routes.PAUSE_BOUNDS in f for f in told)

    def bound_waits(self, seconds: float) -> None:
        """The caller waits at most ``seconds`` for any one call (an engine: its
        ``Timeouts.http_s``), which may be less than this client's request timeout: a wait
        pause's ``wait_s`` is then taken from it, so the server's drain gives up, and undoes
        its pause, before that caller does. Several callers: the shortest bound holds."""
        if not (isinstance(seconds, int | float) and 0 < seconds < math.inf):
            raise ConfigError(f"bound_waits takes a positive finite number of seconds: {seconds!r}")
        self._wait_cap_s = min(self._wait_cap_s, float(seconds))

    def _wait_bound(self, mode: str) -> dict[str, str]:
        """A ``wait`` pause's ``wait_s`` where every server takes it (``PAUSE_BOUNDS``): this
        client's request timeout (or its caller's shorter bound, ``bound_waits``) less a
        margin, so the server's drain gives up (504, its pause undone) while the caller still
        waits for the answer: a pause it gave up on never takes effect later. Before any init
        (a sleep between jobs, a pause before the trainer connects) the servers' features are
        their ``/version`` replies' (asked once)."""
        if mode != "wait":
            return {}
        if not self._inited and self._version_features is None:
            self._ask_version_features()
        if not self.bounds_pause_waits():
            return {}
        waited = min(self.timeout, self._wait_cap_s)
        margin = min(_WAIT_MARGIN_MAX_S, max(_WAIT_MARGIN_MIN_S, _WAIT_MARGIN * waited))
        return {routes.WAIT_BOUND: f"{max(waited - margin, _WAIT_MARGIN_MIN_S):.3f}"}

    def _not_advertised(self, feature: str, call: str, instead: str) -> NotAdvertised:
        """The refusal of ``call``, which needs ``feature`` in every server's init reply."""
        if not self._inited:
            why = "no init_weight_transfer_engine has succeeded on this client yet"
        else:
            lacking = [
                u for u, f in zip(self.base_urls, self._features, strict=True) if feature not in f
            ]
            its = "its init reply" if len(lacking) == 1 else "their init replies"
            why = f"{', '.join(lacking)} did not name it in {its} (stock vLLM never does)"
        return NotAdvertised(
            f"{call} needs every server to advertise {feature!r} at init, but {why}: call "
            f"{instead} instead (as a trainer engine does where this client's "
            f"{_ASKS[feature]}() is false)"
        )

    def _ask_version_features(self) -> None:
        """Each server's server-wide features, as its ``/version`` reply names them (the
        reference server: ``PAUSE_BOUNDS``; stock vLLM's names none). Not kept when a server
        did not answer: the call that asked fails the same way, and the next one asks again."""
        try:
            replies = self._all(routes.VERSION)
        except WeightSyncError:
            return
        self._version_features = [_features(r) for r in replies]

    def pause_and_start(self, mode: str) -> None:
        """``pause(mode)`` then ``start_weight_update()`` on every server, in one request each
        (only where advertised: ``starts_with_pause``). A server whose start was refused by its
        own checks paused nothing; one that failed after may be paused."""
        if mode not in PAUSE_MODES:
            raise ConfigError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        if not self.starts_with_pause():
            raise self._not_advertised(
                routes.START_PAUSES, "pause_and_start", "pause(mode) then start_weight_update()"
            )
        self._all(routes.START, params={"pause": mode, **self._wait_bound(mode)})

    def finishes_with_resume(self) -> bool:
        """Every server's init reply named ``FINISH_RESETS_RESUMES`` (weightwire's reference
        server does; stock vLLM does not): ``finish_reset_resume`` may be used."""
        return all(routes.FINISH_RESETS_RESUMES in f for f in self._features)

    def finish_reset_resume(self, weight_version: str, *, resume: bool = True) -> list[bool]:
        """``finish_weight_update(weight_version)`` that, on every server whose round committed,
        also drops the caches and (``resume``) resumes generation, in the one request (only
        where advertised: ``finishes_with_resume``). Per server, whether it reset its caches.

        Raises as ``finish_weight_update`` does when a finish failed (that server reset and
        resumed nothing); a server that committed but refused the resume (asleep) raises
        ``WeightSyncError`` for ``resume`` after every server answered."""
        if not self.finishes_with_resume():
            raise self._not_advertised(
                routes.FINISH_RESETS_RESUMES,
                "finish_reset_resume",
                "finish_weight_update(weight_version), then reset_prefix_cache() and resume()",
            )
        params = {"reset_caches": "true", "resume": "true" if resume else "false"}
        replies = self._all(routes.FINISH, {"weight_version": weight_version}, params=params)
        refused = refused_resume(replies, self.base_urls, "finish") if resume else None
        if refused is not None:
            raise refused
        return [isinstance(r, dict) and r.get("caches_reset") is True for r in replies]

    def updates_with_finish(self) -> bool:
        """Every server's init reply named ``UPDATE_FINISHES`` (weightwire's reference server;
        never stock vLLM): ``update_and_finish`` may be used."""
        return all(routes.UPDATE_FINISHES in f for f in self._features)

    def update_and_finish(
        self,
        update_info: dict[str, Any] | list[dict[str, Any]],
        weight_version: str | None,
        *,
        reset_caches: bool,
        resume: bool,
    ) -> list[dict[str, Any]]:
        """``update_weights(update_info)`` then, once it succeeded, the round's
        ``finish_weight_update(weight_version)`` with the finish's ``reset_caches`` / ``resume``
        (``finish_reset_resume``), in one request per server (only where advertised:
        ``updates_with_finish``). Per server its reply (``caches_reset``, ``resumed``,
        ``resume_error`` as a finish's).

        A failed update raises as ``update_weights`` does (nothing committed); a failed
        commit raises ``WeightSyncError`` for ``finish_weight_update``, as a failed finish."""
        if weight_version is not None and not isinstance(weight_version, str):
            raise WrongType(f"weight_version must be a str, got {type(weight_version).__name__}")
        if not self.updates_with_finish():
            raise self._not_advertised(
                routes.UPDATE_FINISHES,
                "update_and_finish",
                "update_weights(update_info) then finish_weight_update(weight_version)",
            )
        body: dict[str, Any] = {"update_info": update_info}
        if weight_version is not None:
            body["weight_version"] = weight_version
        params = {
            "finish": "true",
            "reset_caches": "true" if reset_caches else "false",
            "resume": "true" if resume else "false",
        }
        try:
            replies = self._all(routes.UPDATE, body, params=params)
        except WeightSyncError as exc:
            raise _step_named(exc, (routes.FINISH,)) from None
        return [r if isinstance(r, dict) else {} for r in replies]

    def updates_with_start(self) -> bool:
        """Every server's init reply named ``UPDATE_STARTS`` (weightwire's reference server;
        never stock vLLM): ``start_update_finish`` may be used."""
        return all(routes.UPDATE_STARTS in f for f in self._features)

    def start_update_finish(
        self,
        update_info: dict[str, Any] | list[dict[str, Any]],
        weight_version: str | None,
        *,
        pause: str | None,
        reset_caches: bool,
        resume: bool,
    ) -> list[dict[str, Any]]:
        """The whole round in one request per server (only where advertised:
        ``updates_with_start``): ``pause_and_start(pause)`` (no pause: ``None``), then
        ``update_and_finish`` with the same arguments. Per server its reply, as
        ``update_and_finish``'s.

        A refused or failed step raises ``WeightSyncError`` for that step's route:
        ``start_weight_update`` (refused by the start's checks: nothing paused or started),
        ``update_weights`` (nothing committed) or ``finish_weight_update``."""
        if weight_version is not None and not isinstance(weight_version, str):
            raise WrongType(f"weight_version must be a str, got {type(weight_version).__name__}")
        if pause is not None and pause not in PAUSE_MODES:
            raise ConfigError(f"pause mode must be one of {PAUSE_MODES}, got {pause!r}")
        if not self.updates_with_start():
            raise self._not_advertised(
                routes.UPDATE_STARTS,
                "start_update_finish",
                "start_weight_update(), update_weights(...), finish_weight_update(...)",
            )
        body: dict[str, Any] = {"update_info": update_info}
        if weight_version is not None:
            body["weight_version"] = weight_version
        params = {"start": "true"}
        if pause is not None:
            params.update(pause=pause, **self._wait_bound(pause))
        params.update(
            finish="true",
            reset_caches="true" if reset_caches else "false",
            resume="true" if resume else "false",
        )
        try:
            replies = self._all(routes.UPDATE, body, params=params)
        except WeightSyncError as exc:
            raise _step_named(exc, (routes.START, routes.FINISH)) from None
        return [r if isinstance(r, dict) else {} for r in replies]

    # -- the routes around a round (the serving-state ones: ``ServingRoutes``) ------------

    def shutdown_weight_transfer_engine(self) -> None:
        self._all(routes.SHUTDOWN)

    def get_world_size(self) -> int:
        """Inference ranks in the group across every server (see ``control.dp``).

        Independent servers add up; the API servers of one external- or hybrid-LB DP
        deployment each report the deployment's global size and count once.
        """
        self._servers = self._topology()
        self._layout = plan_ranks(self._servers)
        return self._layout.total

    def _sizes(self, include_dp: bool) -> list[int]:
        sizes = []
        params = {"include_dp": "true" if include_dp else "false"}
        for i, reply in enumerate(self._all(routes.WORLD_SIZE, params=params)):
            size = reply.get("world_size") if isinstance(reply, dict) else None
            if type(size) is not int or size < 1:
                raise WeightSyncError(
                    routes.WORLD_SIZE.name,
                    200,
                    f"reply has no positive world_size: {reply!r:.200}",
                    self.base_urls[i],
                )
            sizes.append(size)
        return sizes

    def _topology(self) -> list[ServerTopology]:
        total, per_dp = self._sizes(True), self._sizes(False)
        out = []
        for i, (url, size, per) in enumerate(zip(self.base_urls, total, per_dp, strict=True)):
            parallel = None
            if size != per:  # DP on this server: which DP ranks does its API drive?
                parallel = self._parallel_config(i)
                if parallel is None and len(self._clients) > 1:
                    raise ConfigError(
                        f"{url} runs data parallelism ({size} ranks, {per} per DP "
                        "rank) but does not answer /server_info, so its DP layout "
                        "(internal or external load balancing) is unknown; pass "
                        "one init info per server instead"
                    )
            out.append(ServerTopology(url, size, per, parallel))
        return out

    def _parallel_config(self, i: int) -> dict[str, Any] | None:
        try:
            reply = self._request(i, routes.SERVER_INFO, params={"config_format": "json"})
        except WeightSyncError:
            return None
        config = reply.get("vllm_config") if isinstance(reply, dict) else None
        parallel = config.get("parallel_config") if isinstance(config, dict) else None
        return parallel if isinstance(parallel, dict) else None

    def has_draft_model(self) -> list[bool]:
        """Per server: does ``/server_info`` show a speculative draft model
        (``speculative_config``)?

        Asked before a draft round: vLLM (seen on 0.32) answers ``/start_draft_weight_update``
        on a server without one with a worker error that kills its engine core."""
        out = []
        for i in range(len(self._clients)):
            try:
                reply = self._request(i, routes.SERVER_INFO, params={"config_format": "json"})
            except WeightSyncError:
                out.append(False)
                continue
            config = reply.get("vllm_config") if isinstance(reply, dict) else None
            out.append(
                isinstance(config, dict) and isinstance(config.get("speculative_config"), dict)
            )
        return out

    @property
    def rank_layout(self) -> RankLayout:
        """The servers' rank layout (fetched on first use)."""
        if self._layout is None:
            self.get_world_size()
        assert self._layout is not None
        return self._layout

    @property
    def world_sizes(self) -> list[int]:
        """Per-server world sizes with DP (``/get_world_size?include_dp=true``; fetched on first
        use)."""
        if self._layout is None:
            self.get_world_size()
        return [s.world_size for s in self._servers]

    # -- lifecycle -----------------------------------------------------------------------

    def _per_server_init(self, init_info: dict[str, Any]) -> list[dict[str, Any]]:
        if len(self._clients) == 1 or "rank_offset" not in init_info:
            return [init_info] * len(self._clients)
        shift = init_info["rank_offset"] - 1  # layout offsets start at 1 (the trainer is rank 0)
        return [{**init_info, "rank_offset": offset + shift} for offset in self.rank_layout.offsets]

    def __enter__(self) -> HTTPWeightSyncClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def refused_resume(
    replies: Sequence[Any], servers: Sequence[str], carrier: str
) -> WeightSyncError | None:
    """The first server whose reply to a request that committed and was asked to resume
    (``carrier``: the finish, or the update that finished) says it did not (asleep: its
    ``resume_error``), as a failed ``/resume``; None when every one resumed."""
    for server, reply in zip(servers, replies, strict=False):
        if not (isinstance(reply, dict) and reply.get("resumed") is True):
            why = reply.get("resume_error") if isinstance(reply, dict) else None
            return WeightSyncError(
                routes.RESUME.name,
                _ANSWERED,  # the server answered (was None: "no response")
                str(why or f"the {carrier} did not resume: {reply!r:.200}"),
                server,
            )
    return None


_WAIT_MARGIN, _WAIT_MARGIN_MIN_S, _WAIT_MARGIN_MAX_S = 0.1, 0.5, 30.0
"""A bounded pause's margin (``_wait_bound``): a tenth of the request timeout, 0.5 to 30 s,
for the rest of the request (the start's workers, the answer's way back)."""

_ANSWERED = 200
"""The status of a reply that carried a resume's refusal in its body: the finish (or update)
succeeded (``_request`` raises for any non-2xx status, and the reference server answers them
200); its ``resumed: false`` and ``resume_error`` are the server's word on the resume."""


_ASKS = {
    routes.START_PAUSES: "starts_with_pause",
    routes.FINISH_RESETS_RESUMES: "finishes_with_resume",
    routes.UPDATE_FINISHES: "updates_with_finish",
    routes.UPDATE_STARTS: "updates_with_start",
}
"""Each round feature's question (the method that says every server named it)."""


def _step_named(exc: WeightSyncError, steps: Sequence[routes.Route]) -> WeightSyncError:
    """An error of an update that carried other steps, named for the step that failed: the
    server's message begins with that step's route (``start_weight_update refused: ...``,
    ``finish_weight_update failed: ...``); any other is the update's own."""
    for step in steps:
        if exc.message.startswith(f"{step.name} "):
            return WeightSyncError(step.name, exc.status, exc.message, exc.server, pause=exc.pause)
    return exc


def _features(reply: Any) -> frozenset[str]:
    """The features an init (or ``/version``) reply names (none: a server that names none, e.g.
    stock vLLM)."""
    named = reply.get("features") if isinstance(reply, dict) else None
    if not isinstance(named, list):
        return frozenset()
    return frozenset(f for f in named if isinstance(f, str))
