"""RayWeightSyncClient against real Ray: a local cluster, two inference replicas as Ray
actors (``ReplicaActor``: vLLM's ``LLM`` weight-sync method set over the reference
server's worker engine and a tiny Hugging Face Llama), driven by a JAX and a torch trainer
over ``weightwire_tcp``.

- rounds land on both replicas: every parameter's sha256 equals the trainer's;
- a replica killed mid-round (``ray.kill``) fails the round with one ``WeightSyncError``
  naming that actor, the survivor keeps its previous weights, ``shutdown`` releases it;
- a round after replacing the dead actor lands on both;
- an actor's error reaches the trainer as one line naming it; a stalled actor fails the
  call at the client's timeout, and the abandoned call's late outcome is logged, not lost.

Skipped where ray is not installed (``pip install 'weightwire[ray]'``).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from weightwire.control import RayWeightSyncClient
from weightwire.shared.errors import WeightSyncError
from weightwire.shared.meta import ParamMeta
from weightwire.shared.source import WeightSource
from weightwire.trainer import TrainerInitInfo

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

VERSION = "0.33.0"  # what the actors would report: a vLLM actor has no version call


@pytest.fixture(scope="module")
def model_dir() -> str:
    from weightwire.tools.server.tiny import resolve_model

    return resolve_model("tiny-llama")


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """A CI-sized local cluster: two CPUs, no dashboard, the smallest object store Ray
    accepts. ``ray.init`` sets environment variables and a SIGTERM handler in this
    process; both are put back afterwards. ``ray.shutdown`` signals every Ray process
    but returns before the workers are gone (a torch worker takes seconds to exit on
    a loaded host): the fixture waits for them, so no Ray process outlives the tests."""
    env, on_sigterm, before = (
        dict(os.environ),
        signal.getsignal(signal.SIGTERM),
        descendants(os.getpid()),
    )
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=80 << 20,
        log_to_driver=False,
        namespace="weightwire-tests",
    )
    try:
        yield
    finally:
        started = (
            descendants(os.getpid()) - before
        )  # Ray's processes (the suite's others are not ours)
        ray.shutdown()
        os.environ.clear()
        os.environ.update(env)
        signal.signal(signal.SIGTERM, on_sigterm)
        reap(started, timeout=60)


def _stat(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name (state, ppid, ...); ``None`` once gone or a
    zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields


def descendants(root: int) -> set[int]:
    """Every live process below ``root`` (Linux ``/proc``; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        fields = _stat(int(entry)) if entry.isdigit() else None
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def reap(pids: set[int], *, timeout: float) -> None:
    """Wait for ``pids`` to exit; kill what is left at ``timeout`` (processes this module
    started)."""
    deadline = time.monotonic() + timeout
    while any(_stat(p) is not None for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in pids:
        if _stat(pid) is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def replicas(cluster: None, model_dir: str) -> list[Any]:
    """Two replica actors; the kill tests (last in this file) replace the second."""
    actors = [new_replica(model_dir) for _ in range(2)]
    ray.get([a.get_weight_version.remote() for a in actors], timeout=120)  # both constructed
    return actors


def new_replica(model_dir: str) -> Any:
    from weightwire.testing.ray_replica import ReplicaActor

    # num_cpus=0: replicas share the two cores instead of queueing for them.
    return ray.remote(num_cpus=0)(ReplicaActor).remote(model_dir)


def checksums(actors: list[Any]) -> list[dict[str, str]]:
    return ray.get([a.state_checksums.remote() for a in actors], timeout=60)


def assert_landed(actors: list[Any], want: dict[str, str], version: str) -> None:
    for i, got in enumerate(checksums(actors)):
        assert got == want, (
            f"replica {i}: {sorted(n for n in want if got.get(n) != want[n])[:5]} differ"
        )
    assert ray.get([a.get_weight_version.remote() for a in actors], timeout=60) == [version] * len(
        actors
    )


def jax_trainer(
    model_dir: str,
) -> tuple[WeightSource, Callable[[int], None], Callable[[], dict[str, str]]]:
    """The README's JAX trainer: a Flax decoder loaded from the checkpoint, as HF names."""
    import jax

    from weightwire import PytreeSource, load_decoder
    from weightwire.tools.models import decoder

    cfg, params = load_decoder(model_dir)
    state = {"params": params}
    source = PytreeSource(lambda: state["params"], decoder.naming(cfg))

    def step(k: int) -> None:
        state["params"] = jax.tree.map(lambda p: p + 0.01 * k, state["params"])

    def digests() -> dict[str, str]:
        return {n: hashlib.sha256(np.asarray(t).tobytes()).hexdigest() for n, t in source}

    return source, step, digests


def torch_trainer(
    model_dir: str,
) -> tuple[Any, Callable[[int], None], Callable[[], dict[str, str]]]:
    import torch
    from transformers import AutoModelForCausalLM

    from weightwire import ModuleSource
    from weightwire.torch_side.sender.engine import tensor_bytes

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    source = ModuleSource(model)

    @torch.no_grad()
    def step(k: int) -> None:
        for p in model.parameters():
            p.add_(0.01 * k)

    def digests() -> dict[str, str]:
        return {n: hashlib.sha256(tensor_bytes(t).numpy()).hexdigest() for n, t in source}

    return source, step, digests


@pytest.mark.parametrize("make_trainer", [jax_trainer, torch_trainer], ids=["jax", "torch"])
def test_rounds_land_on_both_replicas(
    replicas: list[Any], model_dir: str, make_trainer: Any
) -> None:
    from weightwire import JAXTrainerEngine, TorchTrainerEngine

    source, step, digests = make_trainer(model_dir)
    engine_cls = JAXTrainerEngine if make_trainer is jax_trainer else TorchTrainerEngine
    client = RayWeightSyncClient(replicas, world_sizes=1, server_version=VERSION)
    engine = engine_cls.trainer_init(
        TrainerInitInfo(backend="weightwire_tcp"), client=client, source=source
    )
    try:
        for k in (1, 2):
            before = checksums(replicas)[0]
            step(k)
            metrics = engine.send_weights()
            want = digests()
            assert metrics.version == str(k) and metrics.tensors == len(want)
            assert all(
                before[n] != d for n, d in want.items()
            )  # every parameter changed this round
            assert_landed(replicas, want, str(k))
    finally:
        engine.shutdown()


def test_an_actor_error_is_one_line_naming_the_actor(replicas: list[Any]) -> None:
    client = RayWeightSyncClient(replicas, world_sizes=1, server_version=VERSION, timeout=60)
    with pytest.raises(WeightSyncError) as info:
        client.start_weight_update()  # no session: every replica refuses
    err = info.value
    assert err.route == "start_weight_update" and err.server.startswith(
        ("actor 0 (Actor(ReplicaActor, ", "actor 1 (Actor(ReplicaActor, ")
    )
    assert err.message == "RuntimeError: weight transfer engine is not initialized on this replica"
    assert "Traceback" not in str(err) and "\x1b[" not in str(
        err
    )  # Ray's remote traceback stays out


class Stalled:
    """An actor whose ``start_weight_update`` answers only after ``delay`` seconds, with a
    refusal."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def start_weight_update(self) -> None:
        time.sleep(self.delay)
        raise RuntimeError("late refusal")


def test_a_stalled_actor_fails_the_call_at_its_timeout(
    cluster: None, caplog: pytest.LogCaptureFixture
) -> None:
    ray.cloudpickle.register_pickle_by_value(
        sys.modules[__name__]
    )  # the workers need not import this module
    try:
        actors = [ray.remote(num_cpus=0)(Stalled).remote(2.0) for _ in range(2)]
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    client = RayWeightSyncClient(actors, timeout=0.5)
    try:
        with caplog.at_level(logging.INFO, logger="weightwire.control.ray_client"):
            with pytest.raises(WeightSyncError) as failed:
                client.start_weight_update()
            err = failed.value
            assert err.server == f"actor 0 ({actors[0]!r}), actor 1 ({actors[1]!r})"
            assert (
                err.message
                == "no answer within 0.5 s (the call may still run there: Ray cannot withdraw it)"
            )
            # The abandoned calls' outcomes are read and logged once each when they arrive.
            deadline = time.monotonic() + 60
            while len(caplog.messages) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
        assert sorted(caplog.messages) == [
            f"start_weight_update on actor {i} ({a!r}), after the call gave up: "
            "RuntimeError: late refusal"
            for i, a in enumerate(actors)
        ]
    finally:
        for actor in actors:
            ray.kill(actor)


class KillMidRound(WeightSource):
    """``inner`` unchanged, except that ``kill`` runs once, just before tensor ``at`` of an armed
    pass."""

    def __init__(self, inner: WeightSource, at: int, kill: Callable[[], None]) -> None:
        self.inner, self.at, self.kill, self.armed = inner, at, kill, False

    def metadata(self) -> list[ParamMeta]:
        return self.inner.metadata()

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for i, pair in enumerate(self.inner):
            if self.armed and i == self.at:
                self.armed = False
                self.kill()
            yield pair


def killer(actor: Any) -> Callable[[], None]:
    """``ray.kill(actor)``, returning once its process is gone. ``ray.kill`` only asks Ray:
    on a loaded host the actor could receive the rest of the round first. Called inside
    the trainer's source iteration, this holds the round's remaining bytes until then."""
    pid = ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=60)

    def kill() -> None:
        ray.kill(actor)
        deadline = time.monotonic() + 60
        while _stat(pid) is not None and time.monotonic() < deadline:
            time.sleep(0.01)

    return kill


@pytest.mark.parametrize("make_trainer", [jax_trainer, torch_trainer], ids=["jax", "torch"])
def test_actor_killed_mid_round_then_replaced(
    replicas: list[Any], model_dir: str, make_trainer: Any
) -> None:
    from weightwire import JAXTrainerEngine, TorchTrainerEngine

    inner, step, digests = make_trainer(model_dir)
    engine_cls = JAXTrainerEngine if make_trainer is jax_trainer else TorchTrainerEngine
    victim = replicas[1]
    source = KillMidRound(inner, at=len(inner.metadata()) // 2, kill=killer(victim))
    # Small chunks: the round is under way (update_weights posted, bytes flowing) when the kill
    # lands.
    info = TrainerInitInfo(backend="weightwire_tcp", packed_buffer_size_bytes=32 << 10)
    engine = engine_cls.trainer_init(
        info,
        client=RayWeightSyncClient(replicas, world_sizes=1, server_version=VERSION),
        source=source,
    )
    try:
        step(1)
        engine.send_weights()
        before = checksums(replicas)
        step(2)
        source.armed = True
        with pytest.raises(WeightSyncError) as failed:
            engine.send_weights()
    finally:
        engine.shutdown()  # the dead actor is skipped; the survivor's session is released
    err = failed.value
    seen = f"{err} {getattr(err, '__notes__', '')}"
    assert err.route == "update_weights" and err.server == f"actor 1 ({victim!r})", seen
    assert err.message.startswith("ActorDiedError: The actor died") and "ray.kill" in err.message, (
        seen
    )
    assert (
        checksums(replicas[:1]) == before[:1]
    )  # the survivor kept its previous weights, not half a round
    assert ray.get(replicas[0].get_weight_version.remote(), timeout=60) == "1"

    replicas[1] = new_replica(model_dir)
    engine = engine_cls.trainer_init(
        info,
        client=RayWeightSyncClient(replicas, world_sizes=1, server_version=VERSION),
        source=source,
    )
    try:
        step(3)
        engine.send_weights("after-replace")
        assert_landed(replicas, digests(), "after-replace")
    finally:
        engine.shutdown()
