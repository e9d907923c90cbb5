"""A CPU stand-in for a data path that hears its workers (``RoundSender.hears_workers``), so a
round against the real reference server goes in one request (``routes.UPDATE_STARTS``).

``weightwire_ipc`` written through reads each worker's go from inside its start (or update)
on its channels before it writes a byte; that needs CUDA. ``HearsWorkers`` gives the
``weightwire_tcp`` data path the same rule: it calls ``Outgoing.heard`` (the trainer's
``begin`` then returns) only once the server's session says the round is open, which it does
once every worker's start returned, inside the one request. Everything else is real: the
server process, its worker, the route, the client, the engine's round and the bytes.

``recorded_engine`` is the set-up those tests (and the finish-in-update combinations) share:
a client that records each request (``recording``), an engine on it, and its data path told
to hear the workers.
"""

from __future__ import annotations

import threading
import time
from typing import Any, NamedTuple

import httpx

from tests.faults.harness import AUTH, CLIENT_TIMEOUT_S, TensorSource, client_for, engine_for

ONE_REQUEST = "update_weights?start=true&{pause}&finish=true&reset_caches={reset}&resume=true"
WAIT_S = f"{CLIENT_TIMEOUT_S * 0.9:.3f}"
"""The bound a ``wait`` pause carries (``routes.PAUSE_BOUNDS``): the client's timeout less a
tenth."""


def pause_query(mode: str) -> str:
    """A start's pause as the client sends it to the reference server."""
    return f"pause={mode}" + (f"&wait_s={WAIT_S}" if mode == "wait" else "")


class HearsWorkers:
    """``inner`` (the session's TCP sender) that says it heard the workers once the server's
    round is open (``/weight_info``'s session state), polled every ``poll_s``."""

    hears_workers = True

    def __init__(self, inner: Any, url: str, poll_s: float = 0.002, first_s: float = 0.0) -> None:
        self._inner, self._poll_s, self._first_s = inner, poll_s, first_s
        self._http = httpx.Client(base_url=url, timeout=10, headers=AUTH)
        self.rounds: list[bool] = []
        """Per round sent: whether it went in one request (``Outgoing.one_request``)."""

    def send(self, out: Any) -> Any:
        self.rounds.append(out.one_request)
        if not out.one_request:
            return self._inner.send(out)
        done = threading.Event()

        def watch() -> None:
            if done.wait(self._first_s):
                return
            while not done.is_set():
                try:
                    state = self._http.get("/weight_info").json()["session"]["state"]
                except (httpx.HTTPError, ValueError, KeyError):
                    state = None
                if state == "round_active":
                    assert out.heard is not None
                    out.heard()
                    return
                time.sleep(self._poll_s)

        watcher = threading.Thread(target=watch, name="hears-workers", daemon=True)
        watcher.start()
        try:
            return self._inner.send(out)
        finally:
            done.set()
            watcher.join(10)

    def close(self) -> None:
        self._http.close()
        self._inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def hearing(engine: Any, url: str, first_s: float = 0.0) -> HearsWorkers:
    """Put ``HearsWorkers`` under ``engine``'s session (after its init); returns it.
    ``first_s``: it looks only that long after the round's send began, so it hears the
    workers well after their start: as a data path whose workers' first word comes from
    their update (``weightwire_ipc``'s want), after the update's checks."""
    wrapped = HearsWorkers(engine.session.sender, url, first_s=first_s)
    engine.session.sender = wrapped
    return wrapped


def recording(url: str) -> Any:
    """A client that records each request's route and query (``client.sent``)."""
    client = client_for(url)
    client.sent = []
    request = client._request

    def recorded(i: int, route: Any, body: Any = None, params: Any = None) -> Any:
        query = "&".join(f"{k}={v}" for k, v in (params or {}).items())
        client.sent.append(route.name + (f"?{query}" if query else ""))
        return request(i, route, body, params)

    client._request = recorded
    return client


class Recorded(NamedTuple):
    """``recorded_engine``'s client (``client.sent``), engine and data path (None unless it
    hears the workers)."""

    client: Any
    engine: Any
    wire: HearsWorkers | None


def recorded_engine(
    url: str, source: TensorSource, *, client: Any = None, hears: bool = True, **info: Any
) -> Recorded:
    """An engine with ``info`` on ``client`` (default: a new ``recording`` one) against the
    server at ``url``; ``hears``: its data path hears the workers (``hearing``), so its rounds
    go in one request where the server offers it."""
    client = recording(url) if client is None else client
    engine = engine_for(url, source, client=client, **info)
    return Recorded(client, engine, hearing(engine, url) if hears else None)
