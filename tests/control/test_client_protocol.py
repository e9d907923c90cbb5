"""The client protocols (``shared.client``) match the names the engine checks at run time,
and our clients and the test doubles satisfy them. The static half (signatures, checked by
mypy in CI through ``[tool.mypy] files``) is ``client_conformance.py``."""

from __future__ import annotations

from typing import Any

import pytest

from tests.trainer.fakes import DictSource, FakeComm, FakeServer
from weightwire.control.fallback import OPTIONAL_CALLS, FallbackClient, with_fallback_routes
from weightwire.control.ray_client import RayWeightSyncClient
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.shared.client import (
    CONTROL_CALLS,
    ROUND_CALLS,
    EngineClient,
    ServerControls,
    WeightSyncClient,
)
from weightwire.shared.communicator import Communicator, DeviceCommunicator
from weightwire.testing.loopback import LoopbackClient
from weightwire.trainer.config import TrainerInitInfo


def _members(protocol: type) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")}


def _lacking(client: object, names: tuple[str, ...]) -> set[str]:
    """The engine's own test for a call (``TrainerEngine._check_client``)."""
    return {name for name in names if not callable(getattr(client, name, None))}


class FourCalls:
    """vLLM's ``HTTPVLLMWeightSyncClient`` shape: the round calls and a ``base_url``."""

    base_url = "http://fake:8000"

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...
    def start_weight_update(self) -> None: ...
    def update_weights(self, update_info: dict[str, Any]) -> None: ...
    def finish_weight_update(self, weight_version: str | None = None) -> None: ...


def test_the_call_names_are_the_protocols_members() -> None:
    assert set(ROUND_CALLS) == _members(WeightSyncClient)
    assert set(CONTROL_CALLS) == _members(ServerControls)
    assert not set(ROUND_CALLS) & set(CONTROL_CALLS)
    assert set(OPTIONAL_CALLS) <= set(CONTROL_CALLS)  # what FallbackClient fills in is optional
    assert not _members(EngineClient)  # only the union of the two


def test_the_http_client_has_every_call() -> None:
    client = FakeServer().client()
    try:
        assert isinstance(client, WeightSyncClient) and isinstance(client, ServerControls)
        assert _lacking(client, ROUND_CALLS + CONTROL_CALLS) == set()
    finally:
        client.close()


def test_ray_and_loopback_clients_have_the_round_calls_and_some_controls() -> None:
    ray = RayWeightSyncClient(object(), world_sizes=1, server_version="0.33.0")
    loopback = LoopbackClient("127.0.0.1:1")  # connects per call: nothing is dialled here
    for client in (ray, loopback):
        assert isinstance(client, WeightSyncClient)
        assert not isinstance(client, ServerControls)
    assert _lacking(ray, CONTROL_CALLS) == {
        "weight_checker",
        "start_draft_weight_update",
        "has_draft_model",
        "abort_requests",
    }
    assert _lacking(loopback, CONTROL_CALLS) == {
        "start_draft_weight_update",
        "has_draft_model",
        "abort_requests",
        "reset_encoder_cache",
    }


def test_a_client_lacking_a_needed_control_fails_at_init_naming_it() -> None:
    ray = RayWeightSyncClient(object(), world_sizes=1, server_version="0.33.0")
    with pytest.raises(TypeError, match=r"RayWeightSyncClient lacks weight_checker"):
        JAXTrainerEngine.trainer_init(
            TrainerInitInfo(backend="fake_host", verify=True),
            client=ray,
            source=DictSource({}, lambda a: ("float32", a.shape)),
        )


def test_fallback_client_has_the_round_calls_and_fills_the_controls() -> None:
    inner = FourCalls()
    client = with_fallback_routes(inner, timeout=5.0)
    assert isinstance(client, FallbackClient)
    try:
        # By name, as the engine checks: on Python >= 3.12 isinstance() no longer sees
        # __getattr__ delegation (it looks attributes up statically).
        assert _lacking(client, ROUND_CALLS + OPTIONAL_CALLS) == set()
        assert client.start_weight_update.__self__ is inner
        assert client.version.__self__ is client.extra
        assert _lacking(client, ("abort_requests",)) == {
            "abort_requests"
        }  # neither has it: still missing
    finally:
        client.close()


def test_the_fake_communicator_is_a_host_communicator() -> None:
    comm = FakeComm()
    assert isinstance(comm, Communicator)
    assert not isinstance(comm, DeviceCommunicator)  # no streams: the host pipeline only
