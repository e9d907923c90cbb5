"""Fault-injection harness: a real reference server in its own process group, a torch
trainer engine in the test process, and probes that read the server's state.

Everything a case asserts about the receiver comes from the server's own routes
(``/weight_checker`` checksums, ``/weight_info`` version and session), never from the
trainer's view, so a round that "succeeded" on the trainer but not on the server is
caught.

The model served is a random Llama of about 64 MB (``tools.server.scaled.SMALL_LLAMA``): larger
than what loopback socket buffers can absorb (4 MiB send + up to 32 MiB autotuned
receive here), so a receiver that stops reading really stalls the sender instead of
the whole round vanishing into kernel buffers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from weightwire.shared.meta import ParamMeta
from weightwire.shared.source import WeightSource
from weightwire.shared.timeouts import Timeouts

FAULT_TIMEOUTS = Timeouts(http_s=20.0, connect_s=8.0, warmup_s=8.0, transfer_s=3.0)
"""Short on purpose: every case must end (error raised, state checked) in seconds."""
CLIENT_TIMEOUT_S = 12.0
"""The HTTP client's own per-call bound (covers the worker's 3 s receive timeout)."""
GRACE_S = 4.0
"""Slack on top of a timeout for "raised within the timeout": thread wake-ups, the
engine's 2 s wait for the server's verdict, a loaded 2-core CI machine."""
API_KEY = "faults-key-6d1f0c2b9a"
"""Every fault server runs with ``--api-key``: the weight routes are exercised authenticated."""
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HOLD_ARGS = ["--decode-step-delay", "0.05"]
"""Server flags for a case against a running generation (``running_generation``): its 240
steps hold the model >= 12 s on any machine, until the case ``released`` it (an abort)."""

BUFFER_BYTES = 64 << 10  # below the first tensor's size: a hook at tensor >= 1 fires after start

POSTED_INIT_INFOS: list[Any] = []
"""Every init info a test client posted: each holds a session secret that must never be logged."""


# ----------------------------------------------------------------------------- model
def load_weights(model_dir: Path) -> dict[str, Any]:
    """The checkpoint as torch tensors (the trainer's starting point)."""
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def sha256_of(tensor: Any) -> str:
    from weightwire.torch_side.sender.engine import tensor_bytes

    return hashlib.sha256(tensor_bytes(tensor).numpy()).hexdigest()


# ----------------------------------------------------------------------------- source
class TensorSource(WeightSource):
    """Name -> torch tensor, with two fault knobs.

    ``hook(i)`` runs just before tensor ``i`` is yielded (the trainer is mid-round: the
    update POST is in flight and earlier chunks are on the wire). ``mutate`` rewrites
    the iteration only, so metadata and iteration disagree as a buggy source would.
    """

    def __init__(self, tensors: dict[str, Any]) -> None:
        self.tensors = dict(tensors)
        self.hook: Callable[[int], None] | None = None
        self.mutate: Callable[[list[tuple[str, Any]]], list[tuple[str, Any]]] | None = None

    def metadata(self) -> list[ParamMeta]:
        from weightwire.torch_side.dtypes import wire_name

        return [ParamMeta(n, wire_name(t.dtype), tuple(t.shape)) for n, t in self.tensors.items()]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        pairs = list(self.tensors.items())
        if self.mutate is not None:
            pairs = self.mutate(pairs)
        for i, pair in enumerate(pairs):
            if self.hook is not None:
                self.hook(i)
            yield pair

    def perturb(self, step: int) -> dict[str, str]:
        """New values for every tensor; returns their expected server checksums."""
        for name, t in self.tensors.items():
            self.tensors[name] = t + np.float32(1e-3 * step)
        return self.expected()

    def expected(self) -> dict[str, str]:
        return {n: sha256_of(t) for n, t in self.tensors.items()}


def hook_at(index: int, action: Callable[[], None]) -> Callable[[int], None]:
    """A source hook that runs ``action`` once, when tensor ``index`` is about to be yielded."""
    fired = threading.Event()

    def hook(i: int) -> None:
        if i == index and not fired.is_set():
            fired.set()
            action()

    return hook


# ----------------------------------------------------------------------------- probes
class Probe:
    """Reads the server's state with plain httpx (independent of weightwire's client)."""

    def __init__(self, url: str, headers: dict[str, str] | None = None) -> None:
        self.http = httpx.Client(
            base_url=url, timeout=30, headers=AUTH if headers is None else headers
        )

    def checksums(self) -> list[dict[str, str]]:
        r = self.http.post("/weight_checker", json={"action": "checksum"})
        assert r.status_code == 200, r.text
        return r.json()["replica_checksums"]

    def version(self) -> str:
        return self.http.get("/weight_info").json()["weight_version"]

    def session(self) -> dict[str, Any]:
        return self.http.get("/weight_info").json()["session"]

    def wait_session(
        self, pred: Callable[[dict[str, Any]], bool], timeout: float
    ) -> tuple[dict[str, Any], float]:
        """Poll ``/weight_info`` until ``pred(session)``; returns it and the seconds waited."""
        start = time.monotonic()
        while True:
            s = self.session()
            if pred(s):
                return s, time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise AssertionError(
                    f"server session never reached the expected state within {timeout} s: {s}"
                )
            time.sleep(0.05)

    def greedy(self, prompt: str = "The trainer sends") -> dict[str, Any]:
        r = self.http.post(
            "/v1/completions",
            json={
                "prompt": prompt,
                "max_tokens": 4,
                "temperature": 0,
                "logprobs": 1,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return {"text": choice["text"], "logprobs": choice["logprobs"]["token_logprobs"]}

    def close(self) -> None:
        self.http.close()


# ----------------------------------------------------------------------------- trainer
def client_for(url: str, **kw: Any) -> Any:
    """An ``HTTPWeightSyncClient`` that also records the init infos it posted (they hold the
    session secret, which the security tests look for in every log)."""
    from weightwire.control import HTTPWeightSyncClient

    class Recording(HTTPWeightSyncClient):
        posted: list[Any]
        tells_served: bool

        def init_weight_transfer_engine(self, init_info: Any) -> None:
            self.posted.append(init_info)
            POSTED_INIT_INFOS.append(init_info)
            super().init_weight_transfer_engine(init_info)

        def served_model(self) -> Any:
            return super().served_model() if self.tells_served else None

    tells_served = kw.pop("tells_served", True)
    client = Recording(
        url, timeout=kw.pop("timeout", CLIENT_TIMEOUT_S), api_key=kw.pop("api_key", API_KEY), **kw
    )
    client.posted = []
    client.tells_served = tells_served
    return client


def engine_for(url: str, source: TensorSource, *, client: Any = None, **info: Any) -> Any:
    """A ``TorchTrainerEngine`` on ``weightwire_tcp`` with the short fault timeouts."""
    from weightwire.torch_side.sender.engine import TorchTrainerEngine
    from weightwire.trainer import TrainerInitInfo

    init = TrainerInitInfo(
        backend="weightwire_tcp",
        packed_buffer_size_bytes=BUFFER_BYTES,
        timeouts=info.pop("timeouts", FAULT_TIMEOUTS),
        **info,
    )
    return TorchTrainerEngine.trainer_init(init, client=client or client_for(url), source=source)


def quiet_shutdown(engine: Any) -> None:
    """Shut an engine down after a fault; its own error is not what the case tests."""
    with contextlib.suppress(Exception):
        engine.shutdown()


@contextlib.contextmanager
def elapsed() -> Iterator[list[float]]:
    """``with elapsed() as t: ...`` then ``t[0]`` is the seconds the block took (even if it
    raised)."""
    box = [0.0]
    start = time.monotonic()
    try:
        yield box
    finally:
        box[0] = time.monotonic() - start


def fresh_round(
    url: str, source: TensorSource, probe: Probe, step: int, version: str, **info: Any
) -> dict[str, str]:
    """A new engine (fresh init) pushes a changed model; every replica must hold it exactly."""
    engine = engine_for(url, source, **info)
    try:
        want = source.perturb(step)
        metrics = engine.send_weights(version)
        assert metrics.version == version
    finally:
        engine.shutdown()
    assert_weights(probe, want, version)
    return want


def committed(probe: Probe) -> tuple[dict[str, str], str]:
    """The server's served checksums and weight version."""
    return probe.checksums()[0], probe.version()


def wait_busy(probe: Probe, op: str) -> None:
    """Until the server is running ``op`` (a round is mid-flight there)."""
    probe.wait_session(lambda s: s["busy"] == op, timeout=10)


def wait_idle(probe: Probe, timeout: float) -> float:
    """Seconds until the server has no weight operation running (its update returned)."""
    return probe.wait_session(lambda s: s["busy"] is None, timeout=timeout)[1]


def assert_weights(probe: Probe, want: dict[str, str], version: str) -> None:
    """Every replica holds exactly ``want`` and the server reports ``version``."""
    for i, replica in enumerate(probe.checksums()):
        assert replica == want, (
            f"replica {i} differs in {sorted(k for k in want if replica.get(k) != want[k])[:5]}"
        )
    assert probe.version() == version


def observe(**values: Any) -> None:
    """Record what a case observed (error texts, seconds) as one JSON line in the file named
    by ``$WEIGHTWIRE_FAULTS_OBSERVE``: the source of the "observed" column of the fault
    table in docs/reliability.md. A no-op when the variable is unset."""
    path = os.environ.get("WEIGHTWIRE_FAULTS_OBSERVE")
    if not path:
        return
    case = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    row = {
        "case": case,
        **{k: (round(v, 2) if isinstance(v, float) else str(v)[:300]) for k, v in values.items()},
    }
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
