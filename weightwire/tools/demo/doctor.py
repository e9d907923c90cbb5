"""``weightwire doctor URL``: can a trainer sync weights into this server, and how fast?

Probes, in order: ``GET /version`` (and the feature gates it implies), the dev-mode
routes (``/weight_info``, ``/get_world_size``, ``/is_paused``: 404 means the server
runs without ``VLLM_SERVER_DEV_MODE=1``), the configured weight-transfer backend
(vLLM's dev-mode ``/server_info``), world size, NCCL versions on both sides, and, on
the reference server only, a timed 1-tensor round over ``weightwire_tcp``.

The round never changes what the server serves: it rewrites one tensor with bytes
the server's own checksum proves it already holds (a freshly initialised norm is all
ones), keeps the served ``weight_version``, and is skipped when no such tensor
exists or a trainer session is active (re-initialising would cut that trainer off).
Its numpy engine needs neither jax nor torch.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from rich.console import Console

from weightwire.backends.nccl.spec import NCCL, WEIGHTWIRE_NCCL
from weightwire.backends.tcp.spec import TCP
from weightwire.shared import routes
from weightwire.shared.dtypes import wire_name_of_numpy
from weightwire.shared.meta import ParamMeta
from weightwire.shared.source import WeightSource
from weightwire.shared.timeouts import Timeouts
from weightwire.shared.version import VERSION_GATES, ServerFeatures
from weightwire.tools._cli import EXIT_ERROR, EXIT_OK, EXIT_VERDICT
from weightwire.tools.demo.probe import Prober, Reply
from weightwire.trainer.engine import TrainerEngine

_MARK = {
    "ok": "[green]ok  [/]",
    "warn": "[yellow]warn[/]",
    "fail": "[bold red]FAIL[/]",
    "info": "[cyan]info[/]",
    "skip": "[dim]skip[/]",
}  # "skip": a check that was not run; its text says why, in plain words


class _Report:
    def __init__(self, console: Console) -> None:
        self.console = console
        self.failed = False

    def __call__(self, level: str, topic: str, text: str) -> None:
        self.failed |= level == "fail"
        self.console.print(f"{_MARK[level]} {topic:<18} {text}", highlight=False, soft_wrap=True)


class NumpyTrainerEngine(TrainerEngine):
    """A trainer engine over numpy arrays (host bytes only: TCP)."""

    def describe(self, tensor: Any) -> tuple[str, tuple[int, ...]]:
        return wire_name_of_numpy(tensor.dtype), tuple(tensor.shape)

    def host_bytes(self, tensor: Any) -> np.ndarray:
        return np.ascontiguousarray(tensor).reshape(-1).view(np.uint8)


class OneTensorSource(WeightSource):
    """A source of exactly one named numpy array."""

    def __init__(self, name: str, array: np.ndarray) -> None:
        self.name, self.array = name, np.ascontiguousarray(array)
        self._meta = ParamMeta(name, wire_name_of_numpy(self.array.dtype), tuple(self.array.shape))

    def metadata(self) -> list[ParamMeta]:
        return [self._meta]

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        yield self.name, self.array


def known_tensor(checksums: dict[str, str], max_len: int = 16384) -> tuple[str, np.ndarray] | None:
    """A ``(name, array)`` whose bytes the server provably holds: a 1-D all-ones or
    all-zeros tensor (fresh norms, biases) of a common dtype whose sha256 matches."""
    import ml_dtypes

    wanted = {
        digest: name
        for name, digest in checksums.items()
        if "norm" in name or name.endswith("bias")
    }
    if not wanted:
        return None
    for dtype in (np.float32, ml_dtypes.bfloat16, np.float16):
        for fill in (1.0, 0.0):
            for n in range(8, max_len + 1, 8):
                array = np.full(n, fill, dtype=dtype)
                name = wanted.get(hashlib.sha256(array.tobytes()).hexdigest())
                if name is not None:
                    return name, array
    return None


def normalize_url(url: str) -> str:
    """``host:port`` -> ``http://host:port`` (what users type); no trailing slash; ``ConfigError``
    for what is not a server URL (``routes.server_url``, the client's reading)."""
    return routes.server_url(url)


def _obj(reply: Reply) -> dict[str, Any]:
    """A 200 reply's JSON object; anything else (an error, a list, null) reads as empty."""
    return reply.body if reply.status == 200 and isinstance(reply.body, dict) else {}


def run_doctor(
    url: str,
    *,
    api_key: str | None = None,
    timeout: float = 15.0,
    deadline: float = 120.0,
    round_trip: bool = True,
    console: Console | None = None,
) -> int:
    """Print a report. 0: nothing blocks a weight sync; 1: a blocking problem was found;
    3: the server gave no usable answer (down, wrong address, or past ``timeout`` /
    ``deadline``)."""
    console = console or Console()
    say = _Report(console)
    url = normalize_url(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    http = Prober(url, headers=headers, timeout=timeout, deadline=time.monotonic() + deadline)
    reply = http.get("/version")
    version = (
        reply.body.get("version") if reply.status == 200 and isinstance(reply.body, dict) else None
    )
    if not isinstance(version, str):
        say(
            "fail",
            "server",
            f"GET {url}/version -> {reply.status or 'no answer'}: {_text(reply.body)}",
        )
        return (
            EXIT_VERDICT
            if reply.status is not None
            else _stopped(console, "the server gave no answer")
        )
    reference = "+weightwire" in version
    say(
        "ok",
        "server",
        f"{url} version {version}" + (" (weightwire reference server)" if reference else ""),
    )
    try:
        features = ServerFeatures.for_version(version)
    except ValueError as exc:
        say("fail", "features", str(exc))
        return EXIT_VERDICT
    gates = ", ".join(
        f"{name} {'yes' if getattr(features, name) else 'NO'}" for _, name, _ in VERSION_GATES
    )
    say("ok" if features.packed_in_init else "fail", "features", gates)
    if not features.unique_id_rendezvous:
        say(
            "warn",
            "features",
            "before 0.30: the torch-free NCCL rendezvous (nccl_unique_id_b64) is missing",
        )

    probes = {path: http.get(path) for path in ("/weight_info", "/get_world_size", "/is_paused")}
    codes = {path: r.status for path, r in probes.items()}
    if all(code == 404 for code in codes.values()):
        say(
            "fail",
            "dev-mode routes",
            "404 on /weight_info, /get_world_size, /is_paused: the "
            "server runs without VLLM_SERVER_DEV_MODE=1, so the "
            "weight-sync routes do not exist; restart it with it set",
        )
        return EXIT_VERDICT
    if any(code in (401, 403) for code in codes.values()):
        say(
            "fail",
            "dev-mode routes",
            f"refused ({codes}): "
            + (
                "the server rejected the API key given (--api-key / WEIGHTWIRE_API_KEY): pass "
                "the server's key"
                if api_key
                else "the server needs an API key: pass --api-key (or set WEIGHTWIRE_API_KEY)"
            ),
        )
        return EXIT_VERDICT
    if any(code is None for code in codes.values()) and http.expired():
        return _stopped(console, f"the doctor's {deadline:g} s deadline passed")
    bad = {
        p: r.status if r.status != 200 else "not a JSON object"
        for p, r in probes.items()
        if r.status != 200 or not isinstance(r.body, dict)
    }
    say("fail" if bad else "ok", "dev-mode routes", f"present; {bad or 'all answer 200'}")
    info, world, paused = (
        _obj(probes[p]) for p in ("/weight_info", "/get_world_size", "/is_paused")
    )
    say(
        "info",
        "state",
        f"weight_version {info.get('weight_version')!r}, world size "
        f"{world.get('world_size')!r}, paused {paused.get('is_paused')!r}",
    )

    backend = _backend(http, say)
    _nccl(http, say, reference)
    if http.expired():
        return _stopped(console, f"the doctor's {deadline:g} s deadline passed")
    if round_trip:
        _round(
            url,
            say,
            api_key=api_key,
            reference=reference,
            backend=backend,
            info=info,
            timeout=max(1.0, http.deadline - time.monotonic()),
        )
    else:
        say("skip", "1-tensor round", "not run: --no-round was given")
    if say.failed:
        console.print("[bold red]doctor: a blocking problem was found (see FAIL above)[/]")
        return EXIT_VERDICT
    console.print("[bold green]doctor: nothing blocks a weight sync[/]")
    return EXIT_OK


def _text(body: Any) -> str:
    return f"{body!r:.200}" if not isinstance(body, str) else body[:200]


def _stopped(console: Console, why: str) -> int:
    console.print(f"[bold red]doctor: stopped: {why}[/]", highlight=False)
    return EXIT_ERROR


def _backend(http: Prober, say: _Report) -> str | None:
    reply = http.get("/server_info", config_format="json")
    if reply.status != 200 or not isinstance(reply.body, dict):
        say(
            "warn",
            "backend",
            f"GET /server_info -> {reply.status or _text(reply.body)}: "
            "cannot read the weight-transfer config",
        )
        return None
    vllm_config = reply.body.get("vllm_config")
    config = vllm_config.get("weight_transfer_config") if isinstance(vllm_config, dict) else None
    name = config.get("backend") if isinstance(config, dict) else None
    if not name or not isinstance(name, str):
        say(
            "fail",
            "backend",
            "no weight-transfer backend configured: start vLLM with "
            '--weight-transfer-config \'{"backend": "nccl"}\' (or '
            "weightwire_tcp / weightwire_nccl with the plugin)",
        )
        return None
    hint = {
        NCCL.name: "trainer needs GPUs + cupy (--transport nccl)",
        TCP.name: "served by the weightwire plugin; works on CPU",
        WEIGHTWIRE_NCCL.name: "served by the weightwire plugin; trainer needs GPUs + cupy",
    }.get(name, "")
    say("ok", "backend", f"{name}" + (f" ({hint})" if hint else ""))
    return name


def _nccl(http: Prober, say: _Report, reference: bool) -> None:
    try:
        from weightwire.backends.nccl.library import nccl_available, nccl_version

        local = nccl_version() if nccl_available() else "n/a (no cupy with NCCL, or no CUDA device)"
    except Exception as exc:  # any CUDA/cupy failure means "not available here"
        local = f"n/a ({type(exc).__name__})"
    remote = "n/a (not reported by the server)"
    if not reference:
        env = _obj(http.get("/server_info", config_format="json")).get("system_env")
        if isinstance(env, dict):
            found = {k: v for k, v in env.items() if "nccl" in str(k).lower() and v}
            if found:
                remote = ", ".join(f"{k}={v}" for k, v in found.items())
    say("info", "NCCL", f"trainer {local}; server {remote} (NCCL versions must match)")


def _round(
    url: str,
    say: _Report,
    *,
    api_key: str | None,
    reference: bool,
    backend: str | None,
    info: dict[str, Any],
    timeout: float,
) -> None:
    from weightwire.control.client import HTTPWeightSyncClient
    from weightwire.trainer.config import TrainerInitInfo

    if not reference:
        say(
            "skip",
            "1-tensor round",
            "not run: it runs only against the weightwire reference server "
            "(on a real vLLM it would reload a layer)",
        )
        return
    if backend not in (None, TCP.name):
        say(
            "skip",
            "1-tensor round",
            f"not run: it needs the weightwire_tcp backend and the server runs {backend}",
        )
        return
    session = info.get("session")
    if not isinstance(session, dict):
        session = {}
    if session.get("state") not in (None, "uninitialized"):
        say(
            "skip",
            "1-tensor round",
            f"not run: a trainer is connected (session {session.get('state')}) and "
            "the round would cut it off",
        )
        return
    with HTTPWeightSyncClient(url, timeout=min(60.0, timeout), api_key=api_key) as client:
        before = client.weight_checker("checksum")[0].get("checksums", {})
        found = known_tensor(before)
        if found is None:
            say(
                "skip",
                "1-tensor round",
                "not run: no served tensor has bytes the doctor can resend unchanged "
                "(the round would change the served weights)",
            )
            return
        name, array = found
        t0 = time.perf_counter()
        try:
            left = Timeouts(http_s=timeout, connect_s=timeout, warmup_s=timeout, transfer_s=timeout)
            engine = NumpyTrainerEngine.trainer_init(
                # One tensor of the model, resent unchanged: partial on purpose.
                TrainerInitInfo(backend=TCP.name, timeouts=left, partial=True),
                client=client,
                source=OneTensorSource(name, array),
            )
        except Exception as exc:  # report, do not crash the doctor
            refused = getattr(exc, "status", None) in (400, 422)
            say(
                "warn" if refused else "fail",
                "1-tensor round",
                "weightwire_tcp init "
                f"{'refused (is the server on another backend?)' if refused else 'failed'}: {exc}",
            )
            return
        init_s = time.perf_counter() - t0
        try:
            metrics = engine.send_weights(
                weight_version=str(info.get("weight_version") or "default")
            )
        finally:
            engine.shutdown()
        after = client.weight_checker("checksum")[0].get("checksums", {})
    same = after == before
    say(
        "ok" if same else "fail",
        "1-tensor round",
        f"weightwire_tcp: rendezvous {init_s * 1e3:.1f} ms, round "
        f"{metrics.total_seconds * 1e3:.1f} ms ({name}, {metrics.nbytes} bytes); served weights "
        f"{'unchanged' if same else 'CHANGED'}",
    )
