"""``AdapterSync``: keep a served LoRA adapter equal to the trainer's, round after round.

The engine's source is an adapter (``jax_side.lora.lora_source``,
``torch_side.sender.lora.PeftAdapterSource``): its metadata names the adapted modules
and the rank (``shared.lora.LoRASpec``). The first ``send`` registers the adapter through
the server's own route (``POST /v1/load_lora_adapter`` from a PEFT directory this
trainer writes once, ``adapter_dir``), unless the server lists it already (``GET
/v1/models``: e.g. vLLM's ``--lora-modules NAME=DIR``); the server refuses there what it
cannot serve (LoRA off, a rank over its ``--max-lora-rank``, a module it does not wrap)
before any byte of a round. Every ``send`` is then an ordinary round over the engine's
backend: the workers stage the adapter and swap it in whole at finish, base weights
untouched.

The directory must be readable by the server (same host or a shared filesystem); it is
written once per ``AdapterSync``, never per round.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from weightwire.backends import get_backend
from weightwire.shared.client import named_servers
from weightwire.shared.dtypes import wire_dtype
from weightwire.shared.errors import ConfigError, WeightSyncError
from weightwire.shared.lora import (
    LoRASpec,
    check_adapter_name,
    check_lora_alpha,
    not_registered,
    write_adapter_dir,
)
from weightwire.shared.meta import ParamMeta
from weightwire.trainer.config import TrainerInitInfo
from weightwire.trainer.engine import TrainerEngine
from weightwire.trainer.metrics import RoundMetrics

LOAD_ROUTE = "/v1/load_lora_adapter"
MODELS_ROUTE = "/v1/models"


class AdapterRefused(ConfigError):
    """A server cannot serve the adapter (LoRA off, rank too high, a module it does not
    wrap, an unreadable directory); nothing of a round was sent."""


class AdapterUnloaded(WeightSyncError):
    """A round's server no longer serves the adapter ``AdapterSync`` registered (unloaded since
    from outside: ``/v1/unload_lora_adapter``, or a restart): its workers refused the round,
    which committed nothing. The next ``send`` registers the adapter again (``register``)."""


class AdapterSync:
    """``AdapterSync(engine, adapter, alpha=..., adapter_dir=...)``; ``send()`` per round.

    ``base_urls``: the servers (default: the engine's client's ``base_urls`` /
    ``base_url``); ``api_key``: their API key, if they require one. ``base_model`` goes into
    ``adapter_config.json`` (informational)."""

    def __init__(
        self,
        engine: TrainerEngine,
        adapter: str,
        *,
        alpha: float,
        adapter_dir: str | os.PathLike[str],
        base_urls: list[str] | None = None,
        base_model: str = "",
        api_key: str | None = None,
        timeout_s: float = 120.0,
    ) -> None:
        if not isinstance(getattr(engine, "info", None), TrainerInitInfo):
            raise ConfigError(
                f"AdapterSync's engine must be a trainer engine (the adapter's own, from "
                f"trainer_init), got {type(engine).__name__}"
            )
        delta = engine.info.delta
        if delta != "off":
            # A delta round would patch the adapter's tensors by name, which the workers'
            # adapter rounds (staged whole, swapped at finish) do not take.
            raise ConfigError(
                f"AdapterSync sends the whole adapter every round; its engine has "
                f"delta={delta!r}: build the adapter's engine with TrainerInitInfo(delta='off') "
                "(an adapter round is small)"
            )
        if get_backend(engine.info.backend).caps.stock_receiver:
            # vLLM's own receivers load every round into the base model's parameters: an
            # adapter's tensors name no base parameter (they would fail, or worse, mid-round).
            raise ConfigError(
                f"AdapterSync needs workers that take adapter rounds (the weightwire plugin's "
                f"backends); backend {engine.info.backend!r} is vLLM's own receiver, which "
                "loads base weights only"
            )
        self.engine = engine
        self.adapter = check_adapter_name(adapter)
        self.alpha = check_lora_alpha(alpha)
        self.adapter_dir = Path(adapter_dir).absolute()
        self.base_urls = base_urls if base_urls is not None else _client_urls(engine.client)
        self.base_model = base_model
        self.timeout_s = timeout_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.spec: LoRASpec | None = None
        """The adapter as registered (None before the first ``send``)."""

    def current_spec(self) -> LoRASpec:
        """The source's adapter now; ``ConfigError`` when it is not ``adapter`` or changed
        shape since registration (a server swaps an adapter of the same shape only)."""
        spec = LoRASpec.from_metas(self.engine.source.metadata())
        if spec.adapter != self.adapter:
            raise ConfigError(
                f"the engine's source sends adapter {spec.adapter!r}, not {self.adapter!r}"
            )
        if self.spec is not None:
            why = self.spec.same_shape(spec)
            if why is not None:
                raise ConfigError(
                    f"adapter {self.adapter!r} cannot change shape after registration: {why}"
                )
        return spec

    def register(self) -> bool:
        """Register the adapter on every server that does not list it yet (idempotent);
        True when at least one server loaded it now."""
        spec = self.current_spec()
        missing = [url for url in self.base_urls if not self._listed(url)]
        if missing:
            metas = {m.name: m for m in self.engine.source.metadata()}
            tensors = {name: self._host(metas[name], t) for name, t in self.engine.source}
            write_adapter_dir(
                self.adapter_dir, spec, tensors, alpha=self.alpha, base_model=self.base_model
            )
            for url in missing:
                self._load(url)
        self.spec = spec
        return bool(missing)

    def send(self, weight_version: str | None = None) -> RoundMetrics:
        """One adapter round (registering the adapter first if needed). A server that no
        longer serves the adapter (unloaded from outside since it was registered) refuses the
        round: ``AdapterUnloaded``, and the next ``send`` registers it again (the registration
        is asked of the servers only then: no request per round)."""
        if self.spec is None:
            self.register()
        else:
            self.current_spec()
        try:
            return self.engine.send_weights(weight_version)
        except WeightSyncError as exc:
            if not_registered(self.adapter) not in exc.message:
                raise
            self.spec = None  # the next send asks the servers and loads it where missing
            raise self._unloaded(exc) from exc

    def _unloaded(self, exc: WeightSyncError) -> AdapterUnloaded:
        then = "call register() (or send() again, which does it) to load it again from "
        then += f"{self.adapter_dir}"
        if getattr(self.engine.session, "broken", None) is not None:
            then += (
                "; the round failed after its start, so its engine needs shutdown() and "
                "trainer_init() first (AdapterSync.engine = the new engine)"
            )
        return AdapterUnloaded(
            exc.route,
            exc.status,
            f"adapter {self.adapter!r} is not loaded on {exc.server} any more: it was "
            "unloaded since this AdapterSync registered it (POST /v1/unload_lora_adapter, or "
            f"the server restarted), so its workers refused the round and nothing was "
            f"committed; {then}. The server said: {exc.message}",
            exc.server,
        )

    # -- HTTP --------------------------------------------------------------------------------

    def _listed(self, url: str) -> bool:
        try:
            r = httpx.get(f"{url}{MODELS_ROUTE}", headers=self._headers, timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            raise AdapterRefused(f"{url}: GET {MODELS_ROUTE} failed: {exc}") from exc
        if r.status_code != 200:
            return False
        data = r.json().get("data", [])
        return any(isinstance(m, dict) and m.get("id") == self.adapter for m in data)

    def _load(self, url: str) -> None:
        body = {"lora_name": self.adapter, "lora_path": str(self.adapter_dir)}
        try:
            r = httpx.post(
                f"{url}{LOAD_ROUTE}", json=body, headers=self._headers, timeout=self.timeout_s
            )
        except httpx.HTTPError as exc:
            raise AdapterRefused(f"{url}: POST {LOAD_ROUTE} failed: {exc}") from exc
        if r.status_code in (404, 405):
            raise AdapterRefused(
                f"{url} has no {LOAD_ROUTE} (HTTP {r.status_code}): it serves no adapters. "
                "Start vLLM with --enable-lora (and --max-lora-rank >= the adapter's rank) and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, or register the adapter at start with "
                f"--lora-modules {self.adapter}=DIR; the reference server: --enable-lora"
            )
        if r.status_code != 200:
            raise AdapterRefused(
                f"{url} refused adapter {self.adapter!r}: HTTP {r.status_code}: {_message(r)}"
            )

    def _host(self, meta: ParamMeta, tensor: Any) -> np.ndarray:
        raw = self.engine.host_bytes(tensor)
        return np.frombuffer(raw, dtype=wire_dtype(meta.dtype).numpy).reshape(meta.shape)


def _client_urls(client: object) -> list[str]:
    urls = named_servers(client)
    if not urls:
        raise ConfigError(
            "the engine's client names no server URL (base_urls / base_url): pass base_urls"
        )
    return [str(u).rstrip("/") for u in urls]


def _message(r: httpx.Response) -> str:
    try:
        body = r.json()
    except ValueError:
        return r.text[:500]
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body.get("message", body)))
        if isinstance(err, dict):
            err = err.get("message", err)
        return str(err)[:500]
    return str(body)[:500]
