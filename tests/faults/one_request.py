"""A CPU stand-in for a data path that hears its workers (``RoundSender.hears_workers``), so a
round against the real reference server goes in one request (``routes.UPDATE_STARTS``).

``weightwire_ipc`` written through reads each worker's go from inside its start (or update)
on its channels before it writes a byte; that needs CUDA. ``HearsWorkers`` gives the
``weightwire_tcp`` data path the same rule: it calls ``Outgoing.heard`` (the trainer's
``begin`` then returns) only once the server's session says the round is open, which it does
once every worker's start returned, inside the one request. Everything else is real: the
server process, its worker, the route, the client, the engine's round and the bytes.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx

from tests.faults.harness import AUTH

ONE_REQUEST = "update_weights?start=true&pause={mode}&finish=true&reset_caches={reset}&resume=true"


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
