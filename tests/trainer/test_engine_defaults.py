"""Safe defaults and duck-typed interop of the round driver (issue #15, items 2 and 6).

- ``pause_mode`` defaults to ``auto``: generation is paused (``keep``) around every round
  to a stock worker whenever the client can pause, and around the commit and cache reset
  of a staging plugin worker's round; resumed even when the round fails, and a server
  without ``/pause`` is driven without it (one warning, no failed round).
- Any object shaped like a source is one: vLLM 0.32's ``metadata()`` method with
  ``__iter__``, and vLLM 0.33's ``metadata`` cached property with ``iter_full()``,
  with torch-style dtypes.
- A foreign client with only the four round calls and a ``base_url`` gets version,
  world size and pause/resume from that server (``control.fallback``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import pytest

from tests.trainer.fakes import FAKE, DictSource, FakeComm, FakeServer, numpy_weights
from tests.trainer.pause_defaults import (
    RESET,
    ROUND,
    UNPAUSED,
    engine_for,
    round_routes,
    stock_fake_comm,
)
from weightwire.backends.base import SenderCaps
from weightwire.control.fallback import FallbackClient, with_fallback_routes
from weightwire.jax_side.dtypes import describe
from weightwire.shared.source import as_source
from weightwire.trainer import TrainerInitInfo


@pytest.fixture(autouse=True)
def fresh_comm(monkeypatch: pytest.MonkeyPatch) -> FakeComm:
    return stock_fake_comm(monkeypatch)


def test_auto_never_pauses_a_staging_plugin_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(type(FAKE), "caps", SenderCaps(on_device=False, stock_receiver=False))
    server = FakeServer()
    engine = engine_for(server.client(), DictSource(numpy_weights(), describe))
    engine.send_weights()
    assert round_routes(server) == UNPAUSED  # the caches are reset right after the commit


def test_default_pauses_with_keep_around_every_round() -> None:
    assert TrainerInitInfo().pause_mode == "auto"
    server = FakeServer()
    engine = engine_for(server.client(), DictSource(numpy_weights(), describe))
    engine.send_weights()
    engine.send_weights()
    assert round_routes(server) == ROUND * 2
    assert server.bodies("pause") == [{"mode": "keep"}] * 2


def test_default_resumes_after_a_failed_round() -> None:
    server = FakeServer()
    server.fail["finish_weight_update"] = (500, "worker exploded")
    engine = engine_for(server.client(), DictSource(numpy_weights(), describe))
    with pytest.raises(Exception, match="worker exploded"):
        engine.send_weights()
    # the resets went out beside the finish (harmless: nothing generated under the pause)
    assert round_routes(server)[-4:] == ["finish_weight_update", *RESET, "resume"]


def test_auto_without_a_pause_route_runs_the_round_and_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = FakeServer()
    server.fail["pause"] = (404, "Not Found")
    engine = engine_for(server.client(), DictSource(numpy_weights(), describe))
    with caplog.at_level(logging.WARNING, logger="weightwire.trainer"):
        assert engine.send_weights().version == "1"
        assert engine.send_weights().version == "2"
    assert round_routes(server) == ["pause"] + UNPAUSED * 2  # asked once, then not again
    assert "no /pause route" in caplog.text


def test_explicit_pause_mode_still_fails_the_round_on_404() -> None:
    server = FakeServer()
    server.fail["pause"] = (404, "Not Found")
    engine = engine_for(server.client(), DictSource(numpy_weights(), describe), pause_mode="keep")
    with pytest.raises(Exception, match="pause failed"):
        engine.send_weights()
    assert "start_weight_update" not in server.routes()


def test_none_never_pauses(caplog: pytest.LogCaptureFixture) -> None:
    server = FakeServer()
    with caplog.at_level(logging.WARNING, logger="weightwire.trainer"):
        engine = engine_for(server.client(), DictSource(numpy_weights(), describe), pause_mode=None)
    engine.send_weights()
    assert round_routes(server) == UNPAUSED
    assert "pause_mode=None: the cache reset after each round runs unpaused" in caplog.text


class FourCalls:
    """A client with the four round calls only, forwarding to a fake server."""

    def __init__(self, server: FakeServer) -> None:
        self._http = server.client()

    def init_weight_transfer_engine(self, info: dict) -> None:
        self._http.init_weight_transfer_engine(info)

    def start_weight_update(self) -> None:
        self._http.start_weight_update()

    def update_weights(self, info: dict) -> None:
        self._http.update_weights(info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._http.finish_weight_update(weight_version)


class FourCallsAndReset(FourCalls):
    def reset_prefix_cache(self) -> list[bool]:
        return self._http.reset_prefix_cache()


def test_auto_with_a_client_that_cannot_pause_warns_and_runs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = FakeServer()
    with caplog.at_level(logging.WARNING, logger="weightwire.trainer"):
        engine = engine_for(
            FourCallsAndReset(server),
            DictSource(numpy_weights(), describe),
            server_version="0.33.0",
            inference_world_size=1,
        )
    engine.send_weights()
    assert "cannot pause generation" in caplog.text
    assert "cannot pause: the cache reset after each round runs unpaused" in caplog.text
    assert round_routes(server) == UNPAUSED[:-1]  # this client has no reset_encoder_cache


def test_fallback_fills_only_the_missing_calls() -> None:
    client = FourCalls(FakeServer())
    assert with_fallback_routes(client, timeout=5) is client  # names no server: nothing to ask
    client.base_url = "http://127.0.0.1:9"  # type: ignore[attr-defined]
    wrapped = with_fallback_routes(client, timeout=5)
    assert isinstance(wrapped, FallbackClient)
    assert wrapped.filled == (
        "version",
        "get_world_size",
        "pause",
        "resume",
        "weight_checker",
        "reset_prefix_cache",
        "reset_encoder_cache",
    )
    assert wrapped.start_weight_update.__self__ is client  # round calls stay with the user's client
    assert wrapped.version.__self__ is wrapped.extra
    assert wrapped.extra.base_urls == ["http://127.0.0.1:9"]
    wrapped.close()
    full = FakeServer().client()
    assert with_fallback_routes(full, timeout=5) is full


# -- duck-typed sources ------------------------------------------------------------------


@dataclass(frozen=True)
class TorchStyleMeta:  # vLLM's ParamMeta: dtype is a framework dtype object
    name: str
    dtype: Any
    shape: tuple[int, ...]


class FakeTorchDtype:
    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"


class Vllm032Source:
    """vLLM 0.32's shape: ``metadata()`` method + ``__iter__``; not our subclass."""

    def __init__(self, weights: dict[str, np.ndarray]) -> None:
        self.weights = weights

    def metadata(self) -> list[TorchStyleMeta]:
        return [
            TorchStyleMeta(n, FakeTorchDtype(str(a.dtype)), a.shape)
            for n, a in self.weights.items()
        ]

    def __iter__(self) -> Iterator[tuple[str, np.ndarray]]:
        return iter(self.weights.items())


class Vllm033Source:
    """vLLM 0.33's shape: ``metadata`` cached property + ``iter_full()``."""

    def __init__(self, weights: dict[str, np.ndarray]) -> None:
        self.weights = weights

    @cached_property
    def metadata(self) -> list[TorchStyleMeta]:
        return [
            TorchStyleMeta(n, FakeTorchDtype(str(a.dtype)), a.shape)
            for n, a in self.weights.items()
        ]

    def iter_full(self) -> Iterator[tuple[str, np.ndarray]]:
        return iter(self.weights.items())


@pytest.mark.parametrize("kind", [Vllm032Source, Vllm033Source])
def test_source_shaped_objects_are_sources(kind: type) -> None:
    weights = {k: v for k, v in numpy_weights(seed=5).items() if v.dtype == np.float32}
    source = as_source(kind(weights))
    metas = source.metadata()
    assert [(m.name, m.dtype, m.shape) for m in metas] == [
        (n, "float32", a.shape) for n, a in weights.items()
    ]
    assert source.metadata() == metas
    server = FakeServer()
    engine = engine_for(server.client(), kind(weights))
    metrics = engine.send_weights()
    assert metrics.tensors == len(weights)
    assert FAKE.comm.broadcasts == [
        b"".join(np.ascontiguousarray(a).tobytes() for a in weights.values())
    ]


def test_a_non_source_is_refused_naming_what_is_missing() -> None:
    class MetadataOnly:
        def metadata(self) -> list:
            return []

    with pytest.raises(TypeError, match=r"MetadataOnly lacks __iter__ or iter_full\(\)"):
        engine_for(FakeServer().client(), MetadataOnly())
    with pytest.raises(TypeError, match="metadata items need name, dtype and shape"):
        as_source(
            type("Odd", (), {"metadata": lambda self: [1], "__iter__": lambda self: iter(())})()
        ).metadata()


def test_a_round_summary_counts_in_words() -> None:
    from weightwire.trainer.metrics import RoundMetrics

    one = RoundMetrics(
        version="1", nbytes=4, tensors=1, chunks=1, reused_metadata=False, seconds={"transfer": 1.0}
    )
    two = RoundMetrics(
        version="2", nbytes=8, tensors=2, chunks=2, reused_metadata=False, seconds={"transfer": 1.0}
    )
    assert "1 tensor, 0.0 MB in 1 broadcast," in one.summary()
    assert "2 tensors, 0.0 MB in 2 broadcasts," in two.summary()
