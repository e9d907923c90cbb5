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

from tests.trainer.commit_order import canonical
from tests.trainer.fakes import FAKE, DictSource, FakeComm, FakeServer, numpy_weights
from weightwire.backends.base import SenderCaps
from weightwire.control.fallback import FallbackClient, with_fallback_routes
from weightwire.jax_side.dtypes import describe
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.shared.source import as_source
from weightwire.shared.timeouts import Timeouts
from weightwire.trainer import TrainerInitInfo

FAST = Timeouts(http_s=10, connect_s=5, warmup_s=5, transfer_s=5)
RESET = ["reset_prefix_cache", "reset_encoder_cache"]
ROUND = ["pause", "start_weight_update", "update_weights", "finish_weight_update", *RESET, "resume"]
PROBE = "weightwire/round_guard"
UNPAUSED = ["start_weight_update", "update_weights", "finish_weight_update", *RESET]


@pytest.fixture(autouse=True)
def fresh_comm(monkeypatch: pytest.MonkeyPatch) -> FakeComm:
    FAKE.comm = FakeComm()
    FAKE.opened.clear()
    # The fake backend stands in for a stock worker here: auto pauses only those.
    monkeypatch.setattr(type(FAKE), "caps", SenderCaps(on_device=False, stock_receiver=True))
    return FAKE.comm


def test_auto_never_pauses_a_staging_plugin_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(type(FAKE), "caps", SenderCaps(on_device=False, stock_receiver=False))
    server = FakeServer()
    engine = engine_for(server.client(), DictSource(numpy_weights(), describe))
    engine.send_weights()
    assert round_routes(server) == UNPAUSED  # the caches are reset right after the commit


def engine_for(client: Any, source: Any, **info: Any) -> JAXTrainerEngine:
    return JAXTrainerEngine.trainer_init(
        TrainerInitInfo(backend="fake_host", timeouts=FAST, **info), client=client, source=source
    )


def round_routes(server: FakeServer) -> list[str]:
    """The round calls (a paused round's finish and resets in their in-line order:
    ``commit_order``)."""
    return canonical(
        [
            r
            for r in server.routes()
            if r not in ("version", "get_world_size", "init_weight_transfer_engine")
        ]
    )


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


# -- a round the plugin workers apply in place (over stage_budget_bytes) ---------------------


def test_auto_pauses_a_round_applied_in_place_with_abort_and_resumes_after_commit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(type(FAKE), "caps", SenderCaps(on_device=False, stock_receiver=False))
    server = FakeServer()
    engine = engine_for(
        server.client(), DictSource(numpy_weights(), describe), stage_budget_bytes=0
    )
    engine.send_weights()
    # No round guard installed: warned, paused all the same.
    assert round_routes(server) == [PROBE, *ROUND]
    assert server.bodies("pause") == [{"mode": "abort"}]  # refusing, not queueing


class FailsOnce(DictSource):
    """Its first pass raises before yielding a tensor (a trainer-side error before any byte)."""

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        self.iterations += 1
        if self.iterations == 1:
            raise RuntimeError("the trainer's weights are not ready")
        yield from self.tensors.items()


def test_a_round_in_place_that_fails_before_its_start_resumes_the_early_pause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The pause goes out beside the round's set-up; a round that fails before its start
    # reached the workers wrote nothing, so generation is resumed, not left refused.
    monkeypatch.setattr(type(FAKE), "caps", SenderCaps(on_device=False, stock_receiver=False))
    server = FakeServer()
    engine = engine_for(server.client(), FailsOnce(numpy_weights(), describe), stage_budget_bytes=0)
    with pytest.raises(RuntimeError, match="not ready"):
        engine.send_weights()
    assert round_routes(server) == [PROBE, "pause", "resume"]
    assert "start_weight_update" not in server.routes()
    engine.send_weights()  # the engine stays usable; the next round is whole
    assert round_routes(server)[3:] == ROUND


def test_a_round_in_place_holds_the_round_guard_until_after_the_commit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(type(FAKE), "caps", SenderCaps(on_device=False, stock_receiver=False))
    server = FakeServer()
    server.guard = True
    source = DictSource(numpy_weights(), describe)
    engine = engine_for(server.client(), source, stage_budget_bytes=0)
    engine.send_weights(weight_version="v3")
    assert round_routes(server) == [PROBE, f"{PROBE}/hold", *ROUND, f"{PROBE}/release"]
    assert server.bodies(f"{PROBE}/hold") == [{"round": "v3", "session": None}]
    assert server.bodies(f"{PROBE}/release") == [{"resume": "false"}]  # the trainer resumed itself


def test_a_failed_round_in_place_leaves_the_guard_to_the_workers(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(type(FAKE), "caps", SenderCaps(on_device=False, stock_receiver=False))
    server = FakeServer()
    server.guard = True
    server.fail["update_weights"] = (500, "worker 0: round failed at chunk 2/3")
    server.fail[f"{PROBE}/release"] = (
        409,
        "not released: worker 0: the model holds an incomplete weight round",
    )
    source = DictSource(numpy_weights(), describe)
    engine = engine_for(server.client(), source, stage_budget_bytes=0)
    with caplog.at_level(logging.ERROR), pytest.raises(Exception, match="round failed at chunk"):
        engine.send_weights()
    routes = round_routes(server)
    assert "resume" not in routes and routes[-1] == f"{PROBE}/release"
    # The guard resumes only if the workers are whole.
    assert server.bodies(f"{PROBE}/release") == [{"resume": "true"}]
    assert "the servers refuse requests that run the model, saying why" in caplog.text


def test_a_round_within_the_budget_is_staged_and_not_paused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(type(FAKE), "caps", SenderCaps(on_device=False, stock_receiver=False))
    weights = numpy_weights()
    server = FakeServer()
    exact = sum(a.nbytes for a in weights.values())
    engine = engine_for(server.client(), DictSource(weights, describe), stage_budget_bytes=exact)
    engine.send_weights()
    # never paused: a trainer that dies mid-round must not leave the server paused; the
    # reset follows the commit
    assert round_routes(server) == UNPAUSED


@pytest.mark.parametrize("route", ["update_weights", "finish_weight_update"])
def test_a_failed_round_applied_in_place_leaves_the_server_refusing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, route: str
) -> None:
    monkeypatch.setattr(type(FAKE), "caps", SenderCaps(on_device=False, stock_receiver=False))
    server = FakeServer()
    server.fail[route] = (500, "worker 0: round failed at chunk 2/3")
    engine = engine_for(
        server.client(), DictSource(numpy_weights(), describe), stage_budget_bytes=0
    )
    with caplog.at_level(logging.ERROR), pytest.raises(Exception, match="round failed at chunk"):
        engine.send_weights()
    assert "resume" not in round_routes(server)
    assert "the servers stay paused" in caplog.text


def test_keep_becomes_abort_for_a_round_applied_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(type(FAKE), "caps", SenderCaps(on_device=False, stock_receiver=False))
    server = FakeServer()
    engine = engine_for(
        server.client(),
        DictSource(numpy_weights(), describe),
        stage_budget_bytes=0,
        pause_mode="keep",
    )
    engine.send_weights()
    assert server.bodies("pause") == [{"mode": "abort"}]


def test_none_opts_out_of_pausing_a_round_applied_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(type(FAKE), "caps", SenderCaps(on_device=False, stock_receiver=False))
    server = FakeServer()
    engine = engine_for(
        server.client(),
        DictSource(numpy_weights(), describe),
        stage_budget_bytes=0,
        pause_mode=None,
    )
    engine.send_weights()
    assert round_routes(server) == UNPAUSED  # no pause at all; the cache reset still runs


def test_stage_budget_is_validated_and_reaches_the_workers() -> None:
    from weightwire.backends.tcp.trainer import TCPBackend
    from weightwire.shared.info import TCPInitInfo

    rdv = TCPBackend().open(
        TrainerInitInfo(backend="weightwire_tcp", stage_budget_bytes=12345), world_size=2
    )
    try:
        assert TCPInitInfo.from_dict(rdv.payload).stage_budget_bytes == 12345
    finally:
        rdv.cancel()
    with pytest.raises(ValueError, match=r"stage_budget_bytes must be an int in \[0, "):
        TrainerInitInfo(stage_budget_bytes=-1)
    with pytest.raises(ValueError, match="stage_budget_bytes must be an int"):
        TrainerInitInfo(stage_budget_bytes=True)
