"""The trainer API misused as a new user would, against the real reference server (``weightwire
serve``): a call of an engine after its ``shutdown()``, a second thread's ``send_weights`` while
a round runs, a source that yields a tensor on torch's meta device, a JAX getter that returns
deleted (donated) arrays, a round of no tensors. Each is refused with a ``WeightwireError``
naming the problem before anything of it is sent, the server keeps serving its committed
weights, and the engine (where it was not shut down) stays usable."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from tests.faults.harness import (
    BUFFER_BYTES,
    FAULT_TIMEOUTS,
    Probe,
    TensorSource,
    assert_weights,
    client_for,
    engine_for,
    hook_at,
    observe,
    quiet_shutdown,
)
from tests.faults.servers import Server
from weightwire.shared.errors import ConfigError
from weightwire.trainer import EngineBroken


def _gpu_host() -> bool:
    from weightwire.backends.nccl.library import nccl_available

    return nccl_available()


def test_a_call_after_shutdown_is_refused_naming_it(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    """``send_weights`` (blocking or not), ``send_patches`` and ``abort_requests`` on an engine
    that was shut down raise ``EngineBroken`` saying so and what to do (was: a bare
    ``RuntimeError``, and ``abort_requests`` still posted to a server whose session may be
    another trainer's by now); nothing reaches the server."""
    engine = engine_for(shared_server.url, source)
    want = source.perturb(41)
    engine.send_weights("before-shutdown")
    engine.shutdown()
    calls: dict[str, Any] = {
        "send_weights": lambda: engine.send_weights("late"),
        "send_weights(wait=False)": lambda: engine.send_weights("late", wait=False),
        "send_patches": lambda: engine.send_patches([], "late"),
        "abort_requests": lambda: engine.abort_requests(),
    }
    for what, call in calls.items():
        with pytest.raises(EngineBroken, match="was shut down") as refused:
            call()
        assert "trainer_init()" in str(refused.value), what
    observe(refused=str(refused.value))
    engine.shutdown()  # still idempotent
    assert_weights(probe, want, "before-shutdown")


def test_a_second_threads_send_weights_is_refused_while_a_round_runs(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    """Two threads call ``send_weights`` of one engine: the second, made while the first's
    round is mid-transfer, raises ``ConfigError`` at once naming the misuse, and sends nothing
    (was: it ran its own round on the same session, its start refused by the server's open
    round or, earlier in the first round, a whole round of its own beside it); the first
    round commits, and the engine goes on."""
    engine = engine_for(shared_server.url, source)
    try:
        engine.send_weights("base")
        want = source.perturb(42)
        inside, go_on = threading.Event(), threading.Event()
        source.hook = hook_at(1, lambda: (inside.set(), go_on.wait(30)))
        first: list[Any] = []
        runner = threading.Thread(target=lambda: first.append(engine.send_weights("first")))
        runner.start()
        try:
            assert inside.wait(30), "the first round never reached its second tensor"
            with pytest.raises(ConfigError, match="another send_weights / send_patches call"):
                engine.send_weights("second")
            with pytest.raises(ConfigError, match="from another thread"):
                engine.send_weights("second", wait=False)
        finally:
            go_on.set()
            runner.join(60)
        assert not runner.is_alive() and first[0].version == "first"
        assert_weights(probe, want, "first")
        source.hook = None
        want = source.perturb(43)
        engine.send_weights("after")
        assert_weights(probe, want, "after")
    finally:
        quiet_shutdown(engine)


@pytest.mark.parametrize(
    ("wait", "index"),
    [(True, 0), (True, 2), (False, 2)],
    ids=["first_tensor", "mid_round", "overlapped"],
)
def test_a_meta_tensor_is_refused_naming_it(
    shared_server: Server, probe: Probe, source: TensorSource, wait: bool, index: int
) -> None:
    """A source that yields a tensor on torch's meta device (a model built without its
    weights) with the right dtype and shape: ``ConfigError`` naming the tensor and the fix
    (was: torch's bare ``NotImplementedError: Cannot copy out of meta tensor``, from the
    packer or the overlapped round's snapshot). The served weights stay. Refused before the
    round's start (the first tensor, or an overlapped round's snapshot, taken before it
    returns), the engine goes on; met mid-round (after its start, tensors streamed), the
    round fails as a source that disagrees with its metadata there does: a new engine goes
    on."""
    engine = engine_for(shared_server.url, source)
    try:
        want = source.perturb(44)
        engine.send_weights("whole")
        empty = list(source.tensors)[index]

        def on_meta(pairs: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
            return [(n, t.to("meta") if n == empty else t) for n, t in pairs]

        source.mutate = on_meta
        source.perturb(45)
        with pytest.raises(ConfigError, match="meta device") as refused:
            engine.send_weights("empty", wait=wait)
        assert repr(empty) in str(refused.value) and "materialize" in str(refused.value)
        observe(refused=str(refused.value))
        assert_weights(probe, want, "whole")
        source.mutate = None
        want = source.expected()
        if index > 0 and wait:
            with pytest.raises(EngineBroken, match="meta device"):
                engine.send_weights("full")
            engine.shutdown()
            engine = engine_for(shared_server.url, source)
        engine.send_weights("full")
        assert_weights(probe, want, "full")
    finally:
        quiet_shutdown(engine)


def test_a_round_of_no_tensors_is_refused_before_any_call(
    shared_server: Server, probe: Probe, source: TensorSource
) -> None:
    """A source with no tensors (``partial=True``: a round may leave tensors out), blocking
    or overlapped, as the session's first round or after one: ``ConfigError`` saying why
    before any call (was: the update info listed no tensor, which the workers read as "the
    previous round's tensors again": after a round, they waited for its bytes until their
    timeout, the round failed and the engine needed a new init; as the first round, refused
    400). The served weights stay and the engine goes on."""
    from tests.faults.one_request import recording

    client = recording(shared_server.url)
    live = TensorSource(dict(source.tensors))
    engine = engine_for(shared_server.url, live, client=client, partial=True)
    everything = dict(live.tensors)
    try:
        for first in (True, False):
            if not first:
                live.tensors = everything
                want = live.perturb(46)
                engine.send_weights("whole")
            live.tensors = {}
            client.sent.clear()
            for wait in (True, False):
                with pytest.raises(
                    ConfigError, match="a round of no tensors cannot be sent"
                ) as refused:
                    engine.send_weights("none", wait=wait)
            assert client.sent == [], client.sent
        observe(refused=str(refused.value))
        assert_weights(probe, want, "whole")
        live.tensors = everything
        want = live.perturb(47)
        engine.send_weights("after")
        assert_weights(probe, want, "after")
    finally:
        quiet_shutdown(engine)


def test_a_jax_leaf_deleted_before_a_round_is_refused_naming_it(
    shared_server: Server, probe: Probe, fault_model: Path
) -> None:
    """A JAX trainer whose getter still returns params a step deleted (donated buffers):
    ``ConfigError`` naming the leaf's path and the fix, from ``send_weights`` before anything
    is sent, blocking or not (was, blocking: JAX's bare ``RuntimeError: Array has been
    deleted``); the server keeps its round, and once the getter returns live params the same
    engine commits."""
    import jax

    from weightwire.jax_side.engine import JAXTrainerEngine
    from weightwire.jax_side.source import PytreeSource
    from weightwire.tools.models import decoder
    from weightwire.tools.models.loading import load_decoder
    from weightwire.trainer import TrainerInitInfo

    cfg, params = load_decoder(fault_model)
    live = {"params": params}
    info = TrainerInitInfo(
        backend="weightwire_tcp", packed_buffer_size_bytes=BUFFER_BYTES, timeouts=FAULT_TIMEOUTS
    )
    engine = JAXTrainerEngine.trainer_init(
        info,
        client=client_for(shared_server.url),
        source=PytreeSource(lambda: live["params"], decoder.naming(cfg)),
    )
    try:
        engine.send_weights("jax-live")
        donated = jax.tree.map(lambda x: x + 0, params)
        jax.tree.leaves(donated)[1].delete()  # what a step with donate_argnums leaves behind
        live["params"] = donated
        for wait in (True, False):
            with pytest.raises(ConfigError, match="was deleted") as refused:
                engine.send_weights("jax-deleted", wait=wait)
            observe(refused=str(refused.value))
        assert "donat" in str(refused.value)
        assert probe.version() == "jax-live"
        live["params"] = jax.tree.map(lambda x: x * 0.5, params)
        engine.send_weights("jax-after")
        assert probe.version() == "jax-after"
    finally:
        quiet_shutdown(engine)


@pytest.mark.skipif(_gpu_host(), reason="this host has CuPy and a CUDA device")
@pytest.mark.parametrize(
    ("framework", "backend", "error"),
    [
        ("torch", "nccl", "NCCLUnavailable"),
        ("torch", "weightwire_ipc", "IPCUnavailable"),
        ("jax", "weightwire_nccl", "NCCLUnavailable"),
        ("jax", "weightwire_ipc", "IPCUnavailable"),
    ],
    ids=["torch_nccl", "torch_ipc", "jax_weightwire_nccl", "jax_ipc"],
)
def test_a_gpu_backend_on_a_host_without_one_is_refused_naming_the_fix(
    shared_server: Server,
    probe: Probe,
    source: TensorSource,
    framework: str,
    backend: str,
    error: str,
) -> None:
    """``trainer_init`` with a GPU backend on a host without CuPy or a CUDA device: the
    backend's ``UnavailableError`` naming it, what is missing (CuPy's install command, or no
    device) and ``weightwire_tcp``, before any rendezvous (the server's session is untouched)
    (was: torch's packer's bare ``RuntimeError: the NCCL path needs CUDA tensors`` for every
    one, IPC included; JAX's bare ``ModuleNotFoundError: No module named 'cupy'``)."""
    from weightwire.shared.errors import UnavailableError
    from weightwire.trainer import TrainerInitInfo

    before = probe.session()
    info = TrainerInitInfo(backend=backend, timeouts=FAULT_TIMEOUTS)
    with pytest.raises(UnavailableError) as refused:
        if framework == "torch":
            from weightwire.torch_side.sender.engine import TorchTrainerEngine

            TorchTrainerEngine.trainer_init(
                info, client=client_for(shared_server.url), source=source
            )
        else:
            import jax.numpy as jnp

            from weightwire.jax_side.engine import JAXTrainerEngine
            from weightwire.jax_side.naming import Naming
            from weightwire.jax_side.rules import Rule
            from weightwire.jax_side.source import PytreeSource

            JAXTrainerEngine.trainer_init(
                info,
                client=client_for(shared_server.url),
                source=PytreeSource({"w": jnp.zeros(2)}, Naming([Rule("w", "w")])),
            )
    assert type(refused.value).__name__ == error and isinstance(refused.value, RuntimeError)
    message = str(refused.value)
    assert repr(backend) in message and "weightwire_tcp" in message
    observe(refused=message)
    assert probe.session() == before
