"""RayWeightSyncClient over a minimal stand-in for ``ray`` (not installed here)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from weightwire.control import RayWeightSyncClient, WeightSyncError


class Ref:
    def __init__(self, value: Any = None, error: Exception | None = None, ready: bool = True) -> None:
        self.value, self.error, self.ready = value, error, ready


class Method:
    def __init__(self, actor: Actor, name: str) -> None:
        self.actor, self.name = actor, name

    def remote(self, *args: Any, **kwargs: Any) -> Ref:
        self.actor.calls.append((self.name, args, kwargs))
        if self.name in self.actor.hang:
            return Ref(ready=False)
        if self.name in self.actor.fail:
            return Ref(error=RuntimeError(self.actor.fail[self.name]))
        return Ref("v3" if self.name == "get_weight_version" else None)


class Actor:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []
        self.fail: dict[str, str] = {}
        self.hang: set[str] = set()

    def __getattr__(self, name: str) -> Method:
        return Method(self, name)


@pytest.fixture(autouse=True)
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    ray = types.ModuleType("ray")

    def wait(refs: list[Ref], num_returns: int, timeout: float) -> tuple[list[Ref], list[Ref]]:
        ready = [r for r in refs if r.ready][:num_returns]
        return ready, [r for r in refs if r not in ready]

    def get(ref: Ref) -> Any:
        if ref.error is not None:
            raise ref.error
        return ref.value

    ray.wait, ray.get = wait, get  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray", ray)


def test_calls_fan_out_to_every_actor_with_per_actor_rank_offsets() -> None:
    actors = [Actor(), Actor()]
    client = RayWeightSyncClient(actors, world_sizes=[2, 3], server_version="0.33.0", timeout=1)
    assert client.get_world_size() == 5 and client.version() == "0.33.0"
    client.init_weight_transfer_engine({"rank_offset": 1, "world_size": 6})
    client.start_weight_update()
    client.update_weights({"names": []})
    client.finish_weight_update("4")
    client.pause("wait")
    assert client.weight_info() == [{"weight_version": "v3"}] * 2
    for i, actor in enumerate(actors):
        names = [c[0] for c in actor.calls]
        assert names == ["init_weight_transfer_engine", "start_weight_update", "update_weights",
                         "finish_weight_update", "pause_generation", "get_weight_version"]
        init_req = actor.calls[0][1][0]
        assert init_req == {"init_info": {"rank_offset": [1, 3][i], "world_size": 6}}
        assert actor.calls[2][1][0] == {"update_info": {"names": []}}
        assert actor.calls[3][1] == ("4",)
        assert actor.calls[4][2] == {"mode": "wait"}


def test_actor_failure_and_timeout_raise_weight_sync_errors() -> None:
    actor = Actor()
    actor.fail["update_weights"] = "receive failed at chunk 2/5"
    actor.hang.add("finish_weight_update")
    client = RayWeightSyncClient(actor, timeout=0.1)
    with pytest.raises(WeightSyncError, match=r"update_weights failed on actor 0 \(no response\): RuntimeError: receive failed at chunk 2/5"):
        client.update_weights({})
    with pytest.raises(WeightSyncError, match="no answer within 0.1 s"):
        client.finish_weight_update()
    with pytest.raises(ValueError, match="world_sizes=...\\) is required"):
        client.get_world_size()
    with pytest.raises(ValueError, match="server_version=...\\) is required"):
        client.version()


class LLMActor(Actor):
    """An actor around vLLM's offline ``LLM``: no ``pause_generation``, no ``reset_encoder_cache``."""

    def __getattr__(self, name: str) -> Method:
        if name in ("pause_generation", "resume_generation", "reset_encoder_cache"):
            raise AttributeError(name)  # as Ray's ActorHandle does for a method the class lacks
        return Method(self, name)


def test_cache_resets_reach_every_actor_and_skip_what_an_actor_lacks(caplog: pytest.LogCaptureFixture) -> None:
    actors = [Actor(), LLMActor()]
    client = RayWeightSyncClient(actors)
    assert client.reset_prefix_cache() == [False, False]  # the stand-in answers None: not a confirmed reset
    for actor in actors:
        assert actor.calls[-1] == ("reset_prefix_cache", (), {"reset_running_requests": True, "reset_connector": True})
    with caplog.at_level("WARNING", logger="weightwire.control"):
        client.reset_encoder_cache()
        client.reset_encoder_cache()
    assert [c[0] for c in actors[0].calls].count("reset_encoder_cache") == 2
    assert "reset_encoder_cache" not in [c[0] for c in actors[1].calls]
    assert caplog.text.count("1 actor(s) have no reset_encoder_cache") == 1


def test_a_method_an_actor_lacks_is_a_404_weight_sync_error() -> None:
    actors = [Actor(), LLMActor()]
    client = RayWeightSyncClient(actors)
    with pytest.raises(WeightSyncError, match="pause_generation failed on actor 1 .status 404.: the actor has no method") as e:
        client.pause("keep")
    assert e.value.status == 404 and actors[0].calls == []  # no actor paused: none left waiting for a resume
