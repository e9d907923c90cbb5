"""RayWeightSyncClient over a minimal stand-in for ``ray``: the call logic, fast and
without a cluster. tests/control/test_ray_actors.py runs it against real Ray."""

from __future__ import annotations

import logging
import sys
import types
from typing import Any

import pytest

from weightwire.control import RayWeightSyncClient
from weightwire.shared.errors import WeightSyncError


class RayActorError(Exception):
    pass


class RayTaskError(Exception):
    def __init__(self, cause: Exception) -> None:
        super().__init__(
            f"Traceback (most recent call last):\n  ...\n{type(cause).__name__}: {cause}"
        )
        self.cause = cause


class Ref:
    def __init__(
        self, value: Any = None, error: Exception | None = None, ready: bool = True
    ) -> None:
        self.value, self.error, self.ready = value, error, ready
        self.callbacks: list[Any] = []

    def future(self) -> Ref:
        return self

    def add_done_callback(self, fn: Any) -> None:
        self.callbacks.append(fn)


class Method:
    def __init__(self, actor: Actor, name: str) -> None:
        self.actor, self.name = actor, name

    def remote(self, *args: Any, **kwargs: Any) -> Ref:
        self.actor.calls.append((self.name, args, kwargs))
        if self.name in self.actor.hang:
            self.actor.hung[self.name] = Ref(ready=False)
            return self.actor.hung[self.name]
        if self.name in self.actor.fail:
            return Ref(error=RayTaskError(RuntimeError(self.actor.fail[self.name])))
        if self.actor.dead:
            return Ref(
                error=RayActorError(
                    "The actor died unexpectedly before finishing this task.\n"
                    "\tclass_name: Actor\nThe actor is dead because it was killed by `ray.kill`."
                )
            )
        return Ref("v3" if self.name == "get_weight_version" else None)


class Actor:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple, dict]] = []
        self.fail: dict[str, str] = {}
        self.hang: set[str] = set()
        self.hung: dict[str, Ref] = {}
        self.dead = False

    def __repr__(self) -> str:
        return "Actor(Replica, 0123)"

    def __getattr__(self, name: str) -> Method:
        return Method(self, name)


@pytest.fixture(autouse=True)
def fake_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    ray = types.ModuleType("ray")

    def wait(refs: list[Ref], num_returns: int, timeout: float) -> tuple[list[Ref], list[Ref]]:
        ready = [r for r in refs if r.ready][:num_returns]
        return ready, [r for r in refs if r not in ready]

    def get(ref: Ref, timeout: float | None = None) -> Any:
        if ref.error is not None:
            raise ref.error
        return ref.value

    ray.wait, ray.get = wait, get  # type: ignore[attr-defined]
    ray.exceptions = types.SimpleNamespace(RayActorError=RayActorError, RayTaskError=RayTaskError)  # type: ignore[attr-defined]
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
        assert names == [
            "init_weight_transfer_engine",
            "start_weight_update",
            "update_weights",
            "finish_weight_update",
            "pause_generation",
            "get_weight_version",
        ]
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
    with pytest.raises(WeightSyncError) as failed:
        client.update_weights({})
    assert str(failed.value) == (
        "update_weights failed on actor 0 (Actor(Replica, 0123)) (no response): "
        "RuntimeError: receive failed at chunk 2/5"
    )  # the actor's error, no Ray traceback
    with pytest.raises(
        WeightSyncError,
        match=r"on actor 0 \(Actor\(Replica, 0123\)\) \(no response\): no answer within 0.1 s",
    ):
        client.finish_weight_update()
    with pytest.raises(ValueError, match="world_sizes=...\\) is required"):
        client.get_world_size()
    with pytest.raises(ValueError, match="server_version=...\\) is required"):
        client.version()


def test_a_dead_actor_is_reported_over_the_errors_it_caused() -> None:
    survivor, dead = Actor(), Actor()
    survivor.fail["update_weights"] = (
        "PeerLost: the trainer closed the link"  # a consequence of the death
    )
    dead.dead = True
    client = RayWeightSyncClient([survivor, dead], timeout=5)
    with pytest.raises(WeightSyncError) as failed:
        client.update_weights({})
    err = failed.value
    assert err.server == "actor 1 (Actor(Replica, 0123))"
    assert err.message == (
        "RayActorError: The actor died unexpectedly before finishing this task. "
        "The actor is dead because it was killed by `ray.kill`."
    )
    assert err.__notes__ == [
        "actor 0 (Actor(Replica, 0123)) also failed: RuntimeError: "
        "PeerLost: the trainer closed the link"
    ]


def test_shutdown_skips_a_dead_actor_and_releases_the_others() -> None:
    survivor, dead = Actor(), Actor()
    dead.dead = True
    RayWeightSyncClient([survivor, dead], timeout=5).shutdown_weight_transfer_engine()
    assert [c[0] for c in survivor.calls] == ["shutdown_weight_transfer_engine"]
    with pytest.raises(WeightSyncError, match="start_weight_update failed on actor 1"):
        RayWeightSyncClient(
            [survivor, dead], timeout=5
        ).start_weight_update()  # a round call still fails


def test_calls_left_running_are_logged_not_left_unread(caplog: pytest.LogCaptureFixture) -> None:
    fast, slow = Actor(), Actor()
    fast.fail["start_weight_update"] = "not initialized"
    slow.hang.add("start_weight_update")
    with pytest.raises(WeightSyncError, match="on actor 0"):
        RayWeightSyncClient([fast, slow], timeout=5).start_weight_update()
    (settled,) = slow.hung[
        "start_weight_update"
    ].callbacks  # read when it arrives, not left to Ray's log
    with caplog.at_level(logging.INFO, logger="weightwire.control.ray_client"):
        settled(types.SimpleNamespace(exception=lambda: RayTaskError(RuntimeError("late failure"))))
    assert caplog.messages == [
        "start_weight_update on actor 1 (Actor(Replica, 0123)), after the call gave up: "
        "RuntimeError: late failure"
    ]


class LLMActor(Actor):
    """An actor around vLLM's offline ``LLM``: no ``pause_generation``, no
    ``reset_encoder_cache``."""

    def __getattr__(self, name: str) -> Method:
        if name in ("pause_generation", "resume_generation", "reset_encoder_cache"):
            raise AttributeError(name)  # as Ray's ActorHandle does for a method the class lacks
        return Method(self, name)


def test_cache_resets_reach_every_actor_and_skip_what_an_actor_lacks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    actors = [Actor(), LLMActor()]
    client = RayWeightSyncClient(actors)
    assert client.reset_prefix_cache() == [
        False,
        False,
    ]  # the stand-in answers None: not a confirmed reset
    for actor in actors:
        assert actor.calls[-1] == (
            "reset_prefix_cache",
            (),
            {"reset_running_requests": True, "reset_connector": True},
        )
    with caplog.at_level("WARNING", logger="weightwire.control"):
        client.reset_encoder_cache()
        client.reset_encoder_cache()
    assert [c[0] for c in actors[0].calls].count("reset_encoder_cache") == 2
    assert "reset_encoder_cache" not in [c[0] for c in actors[1].calls]
    assert caplog.text.count("1 actor(s) have no reset_encoder_cache") == 1


def test_a_method_an_actor_lacks_is_a_404_weight_sync_error() -> None:
    actors = [Actor(), LLMActor()]
    client = RayWeightSyncClient(actors)
    with pytest.raises(
        WeightSyncError,
        match="pause_generation failed on actor 1 .status 404.: the actor has no method",
    ) as e:
        client.pause("keep")
    assert (
        e.value.status == 404 and actors[0].calls == []
    )  # no actor paused: none left waiting for a resume
