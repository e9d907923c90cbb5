"""The HTTP calls of one round against the reference server (``weightwire serve``, one replica,
``weightwire_tcp``), as ``RoundMetrics.http_calls`` counts them: a dense (staged) round is its
start, its update and a finish that also resets the caches; a round applied in place is a
start that pauses first, its update and a finish that also resets the caches and resumes
(the session's first such round also asks once whether a round guard is installed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from weightwire.control import HTTPWeightSyncClient
from weightwire.shared.routes import Route


@pytest.fixture(scope="module")
def server(server_factory: Any, tiny_llama: str) -> Any:
    return server_factory(["--model", tiny_llama])


class Routes(HTTPWeightSyncClient):
    """Records each HTTP request's route and query."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[str] = []

    def _request(
        self, i: int, route: Route, body: Any = None, params: dict[str, Any] | None = None
    ) -> Any:
        query = "&".join(f"{k}={v}" for k, v in (params or {}).items())
        self.sent.append(route.name + (f"?{query}" if query else ""))
        return super()._request(i, route, body, params)


def rounds(url: str, tiny_llama: str, **info: Any) -> list[tuple[int | None, list[str]]]:
    """Two rounds of the checkpoint's tensors: each one's ``http_calls`` and its requests."""
    from safetensors.torch import load_file

    from weightwire.testing.sources import DictSource
    from weightwire.torch_side.dtypes import wire_name
    from weightwire.torch_side.sender.engine import TorchTrainerEngine
    from weightwire.trainer import TrainerInitInfo

    weights = load_file(str(Path(tiny_llama) / "model.safetensors"))
    client = Routes(url, timeout=60)
    engine = TorchTrainerEngine.trainer_init(
        TrainerInitInfo(backend="weightwire_tcp", **info),
        client=client,
        source=DictSource(weights, lambda t: (wire_name(t.dtype), tuple(t.shape))),
    )
    out = []
    try:
        for _ in range(2):
            client.sent.clear()
            metrics = engine.send_weights()
            out.append((metrics.http_calls, list(client.sent)))
    finally:
        engine.shutdown()
        client.close()
    return out


def test_a_dense_round_is_three_http_calls(server: Any, tiny_llama: str) -> None:
    for calls, sent in rounds(server.url, tiny_llama):
        assert sent == [
            "start_weight_update",
            "update_weights",
            "finish_weight_update?reset_caches=true&resume=false",
        ]
        assert calls == len(sent)


def test_a_round_applied_in_place_is_three_http_calls(server: Any, tiny_llama: str) -> None:
    (first_calls, first), (calls, sent) = rounds(server.url, tiny_llama, stage_budget_bytes=0)
    assert sent == [
        "start_weight_update?pause=abort",  # the pause rides on the start
        "update_weights",
        "finish_weight_update?reset_caches=true&resume=true",
    ]
    assert calls == 3
    # the session's first round applied in place asks once whether a round guard is installed
    assert first == ["round_guard", "version", *sent] and first_calls == 5
