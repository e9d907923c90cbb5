"""A test-local trainer: drives the HTTP routes with the bodies vLLM's own client posts
and broadcasts over ``weightwire.backends.tcp.comm`` with ``shared.framing.pack_host``.

Deliberately independent of weightwire's trainer engines: the server is checked
against the raw wire contract, not against our own client.

Also runnable as a subprocess (``python _sender.py``) that is killed mid-round by the
transactional test: it reads commands as JSON lines on stdin.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np

from weightwire.backends.tcp.rendezvous import TCPRendezvous
from weightwire.shared.errors import TransferError
from weightwire.shared.framing import pack_host, plan
from weightwire.shared.meta import ParamMeta

TIMEOUT_S = 30.0


class VLLMStyleClient:
    """The requests vLLM 0.33's ``HTTPVLLMWeightSyncClient`` makes, literally: the same
    paths (base_url + "/" + path), the same bodies (``{"init_info": ...}``,
    ``{"update_info": ...}``, ``{"weight_version": ...}`` or no body at all), and
    ``raise_for_status`` on the reply. httpx stands in for requests (not installed);
    ``json=None`` sends no body with either library."""

    def __init__(
        self, base_url: str, timeout: float = 300, headers: dict[str, str] | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.headers = headers or {}

    def _post(self, path: str, json: dict[str, Any] | None = None) -> None:
        response = httpx.post(
            f"{self.base_url}/{path}", json=json, timeout=self.timeout, headers=self.headers
        )
        response.raise_for_status()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("init_weight_transfer_engine", {"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self._post("shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        self._post("start_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._post("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post(
            "finish_weight_update",
            {"weight_version": weight_version} if weight_version is not None else None,
        )


class Background:
    """Run a call in a thread; ``result()`` re-raises its exception (bounded wait)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._out: list[Any] = []
        self._err: list[BaseException] = []

        def run() -> None:
            try:
                self._out.append(fn())
            except BaseException as exc:  # handed to the test thread
                self._err.append(exc)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def result(self, timeout: float = TIMEOUT_S) -> Any:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError("background call did not return in time")
        if self._err:
            raise self._err[0]
        return self._out[0]


def update_info_of(weights: dict[str, np.ndarray]) -> dict[str, Any]:
    return {
        "names": list(weights),
        "dtype_names": [str(a.dtype) for a in weights.values()],
        "shapes": [list(a.shape) for a in weights.values()],
    }


class TCPSender:
    """Rank 0 of a ``weightwire_tcp`` group against one server with ``replicas`` workers."""

    def __init__(self, client: VLLMStyleClient, *, replicas: int, buffer_size: int = 8192) -> None:
        self.client, self.replicas, self.buffer_size = client, replicas, buffer_size
        self.comm: Any = None

    def init(self, **overrides: Any) -> None:
        rv = TCPRendezvous(world_size=self.replicas + 1)
        info = {
            **rv.init_fields(),
            "rank_offset": 1,
            "world_size": self.replicas + 1,
            "packed": True,
            "packed_buffer_size_bytes": self.buffer_size,
            "packed_num_buffers": 2,
            "timeout_s": TIMEOUT_S,
            **overrides,
        }
        posted = Background(lambda: self.client.init_weight_transfer_engine(info))
        try:
            self.comm = rv.accept(timeout=TIMEOUT_S)
            self.comm.warmup(timeout=TIMEOUT_S)
        finally:
            rv.close()
        posted.result()

    def chunks(self, weights: dict[str, np.ndarray]) -> list[np.ndarray]:
        metas = [ParamMeta(n, str(a.dtype), a.shape) for n, a in weights.items()]
        arrays = list(weights.values())
        return [
            pack_host(arrays[c.start : c.stop], c)
            for c in plan(metas, packed=True, buffer_size_bytes=self.buffer_size)
        ]

    def send_update(
        self,
        weights: dict[str, np.ndarray],
        update_info: Any = None,
        after_chunk: Callable[[int], None] | None = None,
    ) -> Background:
        """POST update_weights in the background and broadcast every chunk; returns the POST."""
        body = update_info_of(weights) if update_info is None else update_info
        posted = Background(lambda: self.client.update_weights(body))
        for i, buf in enumerate(self.chunks(weights)):
            try:
                self.comm.broadcast(buf, timeout=TIMEOUT_S)
            except TransferError:
                # A server that refuses the round drops its workers' links while the POST
                # answers: the broadcast may see the closed link first. The refusal is the
                # answer the round got; a link lost with the POST still pending is the error.
                posted.result()
                raise
            if after_chunk is not None:
                after_chunk(i)
        return posted

    def round(self, weights: dict[str, np.ndarray], version: str | None = None) -> None:
        self.client.start_weight_update()
        self.send_update(weights).result()
        self.client.finish_weight_update(version)

    def close(self) -> None:
        if self.comm is not None:
            self.comm.close()
            self.comm = None


def _subprocess_main() -> int:
    """Reads {"base_url", "replicas", "weights_npz", "buffer_size"} on stdin; inits, starts,
    posts the update, waits until the server is receiving it, broadcasts ONE chunk of
    several, prints "sent-one-chunk" and blocks until killed.

    With {"stuff_bytes": N, "timeout_s": T} instead: inits (``timeout_s`` T), starts, and
    broadcasts N bytes with no update posted (no worker reads them: past the sockets'
    buffers the broadcast blocks), prints "stuffed" and blocks until killed."""
    cfg = json.loads(sys.stdin.readline())
    client = VLLMStyleClient(cfg["base_url"])
    sender = TCPSender(client, replicas=cfg["replicas"], buffer_size=cfg["buffer_size"])
    if "stuff_bytes" in cfg:
        sender.init(timeout_s=cfg["timeout_s"])
        client.start_weight_update()
        stuffing = np.zeros(cfg["stuff_bytes"], dtype=np.uint8)
        Background(lambda: sender.comm.broadcast(stuffing, timeout=TIMEOUT_S))
        time.sleep(0.5)  # the kernel's buffers fill at once; the broadcast then blocks
        print("stuffed", flush=True)
        sys.stdin.readline()  # blocks: the test kills this process here
        return 0
    weights = dict(np.load(cfg["weights_npz"]))
    sender.init()
    client.start_weight_update()
    Background(lambda: client.update_weights(update_info_of(weights)))
    deadline = time.monotonic() + TIMEOUT_S
    while httpx.get(f"{cfg['base_url']}/weight_info").json()["session"]["busy"] != "update_weights":
        if time.monotonic() > deadline:  # the server must be inside update_weights, receiving
            raise TimeoutError("update_weights never started on the server")
        time.sleep(0.02)
    first = sender.chunks(weights)[0]
    sender.comm.broadcast(first, timeout=TIMEOUT_S)
    print("sent-one-chunk", flush=True)
    sys.stdin.readline()  # blocks: the test kills this process here
    return 0


if __name__ == "__main__":
    sys.exit(_subprocess_main())


DRILL_ARGS = ["--decode-step-delay", "0.02"]
"""Server flags for a drill against a running generation: 240 steps take >= 4.8 s."""


def running_generation(
    url: str, headers: dict[str, str] | None = None
) -> tuple[threading.Thread, list[httpx.Response]]:
    """A long greedy completion posted on a thread, returned once the server's replica 0
    holds it (``generations_in_flight`` > 0); its response lands in the list. The server
    must run with ``DRILL_ARGS`` (or a longer step delay): without the step delay a fast
    machine finishes the 240 tokens before the drill's bound. ``headers``: the request's
    (a server with ``--api-key`` wants its bearer); ``released`` ends it early."""
    out: list[httpx.Response] = []
    body = {"prompt": "Hello", "max_tokens": 240, "ignore_eos": True, "temperature": 0}
    t = threading.Thread(
        target=lambda: out.append(
            httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)
        )
    )
    t.start()
    deadline = time.monotonic() + 30
    while httpx.get(url + "/health").json()["replicas"][0]["generations_in_flight"] == 0:
        assert time.monotonic() < deadline and not out, "the request never reached the replica"
        time.sleep(0.005)
    return t, out


def released(
    url: str, t: threading.Thread, out: list[httpx.Response], headers: dict[str, str] | None = None
) -> httpx.Response:
    """End ``running_generation``'s request now (``/abort_requests``: it stops at its next
    step) rather than at its 240th token, and return its response. A drill releases it once
    it has checked what must happen while the generation holds the model."""
    if t.is_alive():
        httpx.post(url + "/abort_requests", headers=headers, timeout=30).raise_for_status()
    t.join(60)
    assert out, "the generation did not end within 60 s of its abort"
    return out[0]
