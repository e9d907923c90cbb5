"""The shared round driver against a fake vLLM server and a recording communicator:
version gates, the reuse shorthand, framing bytes, versions, pause, verify, metrics."""

from __future__ import annotations

import hashlib

import ml_dtypes
import numpy as np
import pytest

from tests.trainer.commit_order import canonical
from tests.trainer.fakes import FAKE, FAST, DictSource, FakeComm, FakeServer, numpy_weights
from tests.trainer.pause_defaults import ROUND
from weightwire.backends import get_backend
from weightwire.jax_side.dtypes import describe
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.shared.framing import pack_host, plan
from weightwire.trainer import EngineBroken, TrainerInitInfo, VerifyError


@pytest.fixture(autouse=True)
def fresh_comm() -> FakeComm:
    FAKE.comm = FakeComm()
    FAKE.opened.clear()
    return FAKE.comm


def make(
    server: FakeServer, weights: dict | None = None, **info: object
) -> tuple[JAXTrainerEngine, DictSource]:
    source = DictSource(weights if weights is not None else numpy_weights(), describe)
    kwargs = {"backend": "fake_host", "timeouts": FAST, **info}
    engine = JAXTrainerEngine.trainer_init(
        TrainerInitInfo(**kwargs), client=server.client(), source=source
    )  # type: ignore[arg-type]
    return engine, source


@pytest.mark.parametrize("backend", ["nccl", "weightwire_nccl"])
def test_029_refuses_unique_id_rendezvous_before_any_init(backend: str) -> None:
    server = FakeServer(version="0.29.1")
    source = DictSource(numpy_weights(), lambda a: (str(a.dtype), a.shape))
    with pytest.raises(
        ValueError,
        match=r"0\.29\.1 lacks unique_id_rendezvous \(needs >= 0\.30; server is release 0\.29\)",
    ):
        JAXTrainerEngine.trainer_init(
            TrainerInitInfo(backend=backend), client=server.client(), source=source
        )
    assert "init_weight_transfer_engine" not in server.routes()


def test_init_posts_backend_payload_and_world_size() -> None:
    server = FakeServer(world_size=3)
    engine, _ = make(server, packed_buffer_size_bytes=4096, packed_num_buffers=3)
    assert FAKE.opened == [4]  # trainer + 3 inference ranks
    (body,) = server.bodies("init_weight_transfer_engine")
    assert body == {
        "init_info": {
            "fake": True,
            "world_size": 4,
            "packed": True,
            "packed_buffer_size_bytes": 4096,
        }
    }
    assert FAKE.comm.warmed


@pytest.mark.parametrize(
    ("version", "reuse"),
    [("0.32.3", False), ("0.33.0", True), ("0.34.0.dev1+g12", False), ("0.33.0rc1", False)],
)
def test_metadata_shorthand_only_for_servers_that_understand_it(version: str, reuse: bool) -> None:
    server = FakeServer(version=version)
    weights = numpy_weights()
    engine, _ = make(server, weights)
    for step in range(3):
        weights["model.norm.weight"] = np.array(
            step, dtype=np.float32
        )  # values change, metadata does not
        metrics = engine.send_weights()
        assert metrics.reused_metadata == (reuse and step > 0)
    bodies = [b["update_info"] for b in server.bodies("update_weights")]
    full = {
        "names": list(weights),
        "dtype_names": [m.dtype for m in engine.source.metadata()],
        "shapes": [list(np.shape(a)) for a in weights.values()],
    }
    empty = {"names": [], "dtype_names": [], "shapes": []}
    assert bodies[0] == full
    assert bodies[1:] == ([empty, empty] if reuse else [full, full])
    # The bytes still flow every round, whatever the update info says.
    assert len(FAKE.comm.broadcasts) == 3
    weights["model.norm.weight"] = np.zeros(
        (2,), dtype=np.float32
    )  # shape change: full lists again
    engine.send_weights()
    assert server.bodies("update_weights")[-1]["update_info"]["shapes"][4] == [2]


@pytest.mark.parametrize(("packed", "buffer"), [(True, 64), (True, 1 << 20), (False, 64)])
def test_broadcast_bytes_follow_the_plan(packed: bool, buffer: int) -> None:
    server = FakeServer()
    weights = numpy_weights(seed=3)
    engine, source = make(server, weights, packed=packed, packed_buffer_size_bytes=buffer)
    metrics = engine.send_weights()
    metas = source.metadata()
    chunks = plan(metas, packed=packed, buffer_size_bytes=buffer)
    arrays = list(weights.values())
    want = [pack_host(arrays[c.start : c.stop], c).tobytes() for c in chunks]
    assert FAKE.comm.broadcasts == want
    assert metrics.chunks == len(chunks) and metrics.tensors == len(metas)
    assert metrics.nbytes == sum(m.nbytes for m in metas) == sum(map(len, want))
    assert set(metrics.seconds) == {"metadata", "control", "transfer", "finish"}
    assert metrics.gbps > 0


def test_round_order_versions_and_pause() -> None:
    server = FakeServer()
    engine, _ = make(server, pause_mode="keep")
    engine.send_weights()
    engine.send_weights(weight_version="step-7")
    engine.send_weights()
    round_routes = [
        r
        for r in canonical(server.routes())
        if r not in ("version", "get_world_size", "init_weight_transfer_engine")
    ]
    assert round_routes == ROUND * 3
    assert server.bodies("reset_prefix_cache")[0] == {
        "reset_running_requests": "true",
        "reset_external": "true",
    }
    assert server.bodies("pause")[0] == {"mode": "keep"}
    assert [b["weight_version"] for b in server.bodies("finish_weight_update")] == [
        "1",
        "step-7",
        "3",
    ]  # the round number
    with pytest.raises(ValueError, match="weight_version must be a non-empty str"):
        engine.send_weights(weight_version="")


def test_a_weight_version_over_the_limit_fails_every_rank_before_any_cross_rank_wait() -> None:
    """Several trainer ranks: each one checks the version it was given before the round's
    first exchange, so a bad one fails every rank at once (rank 0 alone raising would leave
    the others waiting for its verdict until their timeout)."""
    import types

    from weightwire.shared.errors import ConfigError
    from weightwire.shared.limits import LIMITS
    from weightwire.trainer.multi_source import MultiSource
    from weightwire.trainer.session import Session

    steps: list[str] = []
    session = types.SimpleNamespace(rounds=0)
    session.next_version = lambda v: Session.next_version(session, v)  # type: ignore[arg-type]
    rank = types.SimpleNamespace(
        session=session, exchange=types.SimpleNamespace(step=lambda: steps.append("step"))
    )
    too_long = "v" * (LIMITS.max_weight_version_chars + 1)
    with pytest.raises(ConfigError, match="over the 1024 a server takes"):
        MultiSource.send(rank, too_long, False)  # type: ignore[arg-type]
    assert steps == []


def test_failed_round_still_resumes_and_breaks_the_engine() -> None:
    server = FakeServer()
    server.fail["update_weights"] = (500, "worker 0: CUDA error: out of memory")
    engine, _ = make(server, pause_mode="abort")
    with pytest.raises(Exception, match="update_weights failed .*status 500.*out of memory"):
        engine.send_weights()
    assert server.routes()[-1] == "resume"
    assert "finish_weight_update" not in server.routes()
    with pytest.raises(EngineBroken, match="previous round failed"):
        engine.send_weights()


def test_verify_compares_every_sent_tensor() -> None:
    server = FakeServer()
    weights = numpy_weights()
    engine, _ = make(server, weights, verify=True)
    digests = {
        n: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest() for n, a in weights.items()
    }
    server.checksums = dict(digests, **{"extra.unsent": "00"})
    metrics = engine.send_weights()
    assert "verify" in metrics.seconds
    server.checksums = dict(digests, **{"model.layers.0.mlp.up_proj.weight": "ff" * 32})
    with pytest.raises(
        VerifyError,
        match=r"server 0: 1 of 6 tensors differ .*model\.layers\.0\.mlp\.up_proj\.weight",
    ):
        engine.send_weights()
    del server.checksums["lm_head.weight"]
    with pytest.raises(VerifyError, match="absent on the server"):
        engine.send_weights()
    # A verify failure comes after the commit: versions keep counting committed rounds.
    assert [b["weight_version"] for b in server.bodies("finish_weight_update")] == ["1", "2", "3"]


def test_non_sender_rank_only_iterates() -> None:
    server = FakeServer()
    engine, source = make(server, rank=1)
    assert server.calls == [] and FAKE.opened == []
    metrics = engine.send_weights()
    assert source.iterations == 1 and not metrics.sender and metrics.nbytes == 0
    assert server.calls == []


def test_shutdown_calls_the_route_only_where_it_exists() -> None:
    server = FakeServer(version="0.32.0")
    engine, _ = make(server)
    engine.shutdown()
    engine.shutdown()  # idempotent
    assert server.routes().count("shutdown_weight_transfer_engine") == 1 and FAKE.comm.closed
    old = FakeServer(version="0.31.0")
    FAKE.comm = FakeComm()
    engine, _ = make(old)
    engine.shutdown()
    assert "shutdown_weight_transfer_engine" not in old.routes() and FAKE.comm.closed
    with pytest.raises(RuntimeError, match="shut down"):
        engine.send_weights()


def test_jax_arrays_are_sent_bit_exact() -> None:
    import jax.numpy as jnp

    server = FakeServer()
    weights = {n: jnp.asarray(a) for n, a in numpy_weights(seed=5).items()}
    weights["model.layers.0.post_attention_layernorm.weight"] = jnp.array([True, False, True])
    engine, _ = make(server, weights, packed=False)
    engine.send_weights()
    want = [np.asarray(a).tobytes() for a in weights.values()]
    assert FAKE.comm.broadcasts == want
    assert np.asarray(weights["model.layers.0.self_attn.q_proj.weight"]).dtype == ml_dtypes.bfloat16


def test_trainer_init_validates_inputs() -> None:
    server = FakeServer()
    with pytest.raises(ValueError, match="unknown backend 'ipc'"):
        TrainerInitInfo(backend="ipc")
    with pytest.raises(ValueError, match="pause_mode must be None, 'auto' or one of"):
        TrainerInitInfo(pause_mode="stop")
    with pytest.raises(ValueError, match="packed_num_buffers must be an int in"):
        TrainerInitInfo(packed_num_buffers=0)
    with pytest.raises(
        TypeError, match="a weight source needs metadata and iteration; NoneType lacks"
    ):
        JAXTrainerEngine.trainer_init(
            TrainerInitInfo(backend="fake_host"), client=server.client(), source=None
        )

    class FourCalls:  # a minimal adapter: the four calls only
        def init_weight_transfer_engine(self, info): ...
        def start_weight_update(self): ...
        def update_weights(self, info): ...
        def finish_weight_update(self, weight_version=None): ...

    source = DictSource(numpy_weights(), lambda a: ("float32", a.shape))
    with pytest.raises(TypeError, match="lacks version, get_world_size, reset_prefix_cache "):
        JAXTrainerEngine.trainer_init(
            TrainerInitInfo(backend="fake_host"), client=FourCalls(), source=source
        )
    hinted = {"backend": "fake_host", "server_version": "0.33.0", "inference_world_size": 2}
    with pytest.raises(
        TypeError, match="lacks reset_prefix_cache .*reset_prefix_cache=False accepts that"
    ):
        JAXTrainerEngine.trainer_init(TrainerInitInfo(**hinted), client=FourCalls(), source=source)
    engine = JAXTrainerEngine.trainer_init(
        TrainerInitInfo(**hinted, reset_prefix_cache=False), client=FourCalls(), source=source
    )
    assert FAKE.opened[-1] == 3 and engine.features is not None and engine.features.reuse_metadata
    assert get_backend("fake_host") is FAKE


def test_verify_checks_every_replica_of_every_server() -> None:
    from weightwire.trainer.verify import compare_checksums

    sent = {"a": "01", "b": "02"}
    good = {"checksums": sent, "replica_checksums": [sent, sent]}
    compare_checksums(sent, [good, {"checksums": dict(sent, c="03")}])
    bad_replica = {"checksums": sent, "replica_checksums": [sent, {"a": "01", "b": "ff"}]}
    with pytest.raises(
        VerifyError, match=r"server 1 replica 1: 1 of 2 tensors differ from what was sent: b$"
    ) as info:
        compare_checksums(sent, [good, bad_replica])
    assert info.value.mismatched == {"server 1 replica 1": ["b"]}
    with pytest.raises(VerifyError, match="without a checksums map"):
        compare_checksums(sent, [{"status": "reset"}])


def test_a_pytree_source_round_describes_each_tensor_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # The source checks its own pass against metadata(); the engine must not check it again
    # (checked_iter twice per tensor was a hop on the byte path), and the bytes are unchanged.
    import jax.numpy as jnp

    import weightwire.jax_side.engine as jax_engine_mod
    import weightwire.jax_side.source as jax_source_mod
    from weightwire.jax_side import PytreeSource
    from weightwire.jax_side.naming import Naming
    from weightwire.jax_side.rules import Rule

    calls: list[str] = []

    def counting(tensor: object) -> tuple[str, tuple[int, ...]]:
        calls.append("describe")
        return describe(tensor)

    monkeypatch.setattr(jax_source_mod, "describe", counting)
    monkeypatch.setattr(jax_engine_mod, "_describe", counting)
    params = {"a": jnp.arange(4.0), "b": jnp.ones((2, 3), jnp.bfloat16)}
    source = PytreeSource(params, Naming([Rule("{x}", "{x}")]))
    engine = JAXTrainerEngine.trainer_init(
        TrainerInitInfo(backend="fake_host", timeouts=FAST, packed=False),
        client=FakeServer().client(),
        source=source,
    )
    calls.clear()
    engine.send_weights()
    assert calls == ["describe"] * len(params)
    assert FAKE.comm.broadcasts == [np.asarray(a).tobytes() for a in params.values()]
