"""Delta rounds through a patch backend (``sparse_nccl``'s plan) against a fake vLLM server and
a recording communicator: the base rule (anchor first; after any failed round, an anchor
again), the update info posted, the bytes broadcast, and what is refused before any call."""

from __future__ import annotations

from typing import Any, ClassVar

import ml_dtypes
import numpy as np
import pytest

from tests.trainer.fakes import FAST, DictSource, FakeBackend, FakeComm, FakeServer
from weightwire.backends import register_backend
from weightwire.backends.base import PatchPlan, SenderCaps, WirePlan
from weightwire.backends.nccl.sparse import sparse_nccl_round
from weightwire.backends.nccl.trainer import SparseNCCLBackend
from weightwire.jax_side.dtypes import describe
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.shared.errors import ConfigError
from weightwire.shared.patches import SparsePatch
from weightwire.trainer import TrainerInitInfo
from weightwire.trainer.patch_round import (
    SparseBaseUnknown,
    anchor_patches,
    base_known,
    patches_from_wire,
)

ROUND = ["start_weight_update", "update_weights", "finish_weight_update"]


class FakePatchBackend(FakeBackend):
    """The fake host wire, planned as ``sparse_nccl`` plans (a stock receiver of patches)."""

    name: ClassVar[str] = "fake_patches"
    caps: ClassVar[SenderCaps] = SenderCaps(on_device=False, stock_receiver=True, delta=True)

    def plan_patches(self, patches: Any, *, features: Any, describe: Any) -> PatchPlan:
        return sparse_nccl_round(patches, features=features, describe=describe)

    def plan_round(self, metas: Any, **kw: Any) -> WirePlan:
        return SparseNCCLBackend().plan_round(metas, **kw)


BACKEND = FakePatchBackend()
register_backend(BACKEND, replace=True)


def weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((6, 4)).astype(ml_dtypes.bfloat16),
        "model.norm.weight": rng.standard_normal((4,)).astype(np.float32),
    }


def delta(w: dict[str, np.ndarray]) -> list[SparsePatch]:
    a = w["model.norm.weight"]
    return [
        SparsePatch("model.norm.weight", "float32", a.shape, np.array([1, 3], np.int32), a[[1, 3]])
    ]


def anchor(engine: JAXTrainerEngine) -> list[SparsePatch]:
    return anchor_patches(engine.source, describe, lambda n: np.arange(n, dtype=np.int32))


@pytest.fixture
def server() -> FakeServer:
    BACKEND.comm = FakeComm()
    return FakeServer(version="0.33.0")


def make(server: FakeServer, **info: Any) -> JAXTrainerEngine:
    return JAXTrainerEngine.trainer_init(
        TrainerInitInfo(backend="fake_patches", timeouts=FAST, **info),
        client=server.client(),
        source=DictSource(weights(), describe),
    )


def round_calls(server: FakeServer) -> list[str]:
    return [r for r in server.routes() if r in ROUND]


def test_an_anchor_first_then_deltas(server: FakeServer) -> None:
    engine = make(server)
    w = weights()
    with pytest.raises(SparseBaseUnknown, match="no round committed in this session yet"):
        engine.send_patches(delta(w))
    assert round_calls(server) == [] and BACKEND.comm.broadcasts == []

    engine.send_patches(anchor(engine), weight_version="a")
    assert base_known(engine.session)
    # Paused with abort (requests refused, not queued) around a round applied in place.
    assert server.bodies("pause")[0]["mode"] == "abort"
    assert [r for r in server.routes() if r in ("pause", *ROUND, "resume")] == [
        "pause",
        *ROUND,
        "resume",
    ]
    engine.send_patches(delta(w), weight_version="d")
    assert round_calls(server) == ROUND * 2
    info = server.bodies("update_weights")[-1]["update_info"]
    assert info == {
        "names": ["model.norm.weight"],
        "dtype_names": ["float32"],
        "shapes": [[4]],
        "num_updates_list": [2],
    }
    # The last round's two broadcasts: its int32 indices, then its values.
    assert BACKEND.comm.broadcasts[-2:] == [
        np.array([1, 3], np.int32).tobytes(),
        w["model.norm.weight"][[1, 3]].tobytes(),
    ]
    assert server.weight_version == "d"
    engine.shutdown()


@pytest.mark.parametrize("route", ["update_weights", "finish_weight_update"])
def test_after_a_failed_round_only_an_anchor_is_sent(server: FakeServer, route: str) -> None:
    engine = make(server)
    engine.send_patches(anchor(engine))
    server.fail[route] = (500, "worker failed mid-round")
    with pytest.raises(Exception, match="worker failed mid-round"):
        engine.send_patches(delta(weights()))
    del server.fail[route]
    assert not base_known(engine.session)
    # The failed round left the servers paused: they may hold part of it.
    routes = server.routes()
    last_pause = len(routes) - 1 - routes[::-1].index("pause")
    assert "resume" not in routes[last_pause:]
    if route == "finish_weight_update":  # nothing broke on the wire: the engine goes on
        before = len(server.routes())
        with pytest.raises(SparseBaseUnknown, match="the last round failed"):
            engine.send_patches(delta(weights()))
        assert len(server.routes()) == before  # refused before any call
        engine.send_patches(anchor(engine))
        assert base_known(engine.session) and server.routes()[-1] == "resume"
        engine.send_patches(delta(weights()))
    engine.shutdown()


def test_refused_before_any_call(server: FakeServer) -> None:
    engine = make(server)
    engine.send_patches(anchor(engine))
    before = len(server.routes())
    bad = SparsePatch(
        "model.nope", "float32", (4,), np.array([0], np.int32), np.zeros(1, np.float32)
    )
    with pytest.raises(ConfigError, match="'model.nope' names no tensor of the source"):
        engine.send_patches([bad])
    wrong = SparsePatch(
        "model.norm.weight", "float32", (2, 2), np.array([0], np.int32), np.zeros(1, np.float32)
    )
    with pytest.raises(ConfigError, match=r"declares float32 \[2, 2\], the source's tensor is"):
        engine.send_patches([wrong])
    with pytest.raises(ValueError, match="needs at least one patch"):
        engine.send_patches([])
    with pytest.raises(ConfigError, match="receives patches only"):
        engine.send_weights()
    assert len(server.routes()) == before
    assert base_known(engine.session)  # a refusal sent nothing: the base stays known
    engine.shutdown()


def test_verify_is_refused_for_delta_rounds(server: FakeServer) -> None:
    server.checksums = {}
    engine = make(server, verify=True)
    with pytest.raises(ConfigError, match="verify=True compares whole-tensor checksums"):
        engine.send_patches(anchor(engine))
    engine.shutdown()


def test_a_generic_delta_round_becomes_sparse_patches(server: FakeServer) -> None:
    # The generic delta wire (T@index, T@values; a tensor sent whole under its name), as a
    # receiver that takes only patches gets it: the whole tensor is patched everywhere.
    w = weights()
    up, norm = "model.layers.0.mlp.up_proj.weight", "model.norm.weight"
    idx = np.array([0, 2], np.int32)
    wire = [(up, w[up]), (norm + "@index", idx), (norm + "@values", w[norm][idx])]
    shapes = {up: (6, 4), norm: (4,)}
    patches = patches_from_wire(
        wire, describe, lambda n, like: np.arange(n, dtype=np.int32), shapes
    )
    assert [(p.name, p.dtype, p.shape) for p in patches] == [
        (up, "bfloat16", (6, 4)),
        (norm, "float32", (4,)),
    ]
    every = patches[0].index  # made only when sent
    assert every.materialize().tolist() == list(range(24)) and patches[1].index is idx
    engine = make(server)
    engine.send_patches(anchor(engine))
    engine.send_patches(patches)
    info = server.bodies("update_weights")[-1]["update_info"]
    assert info["names"] == [up, norm] and info["num_updates_list"] == [24, 2]
    engine.shutdown()
    with pytest.raises(ConfigError, match="is not followed by 'model.norm.weight@values'"):
        patches_from_wire(wire[1:2], describe, lambda n, like: np.arange(n), shapes)


def test_delta_auto_sends_patches_only(server: FakeServer) -> None:
    # delta="auto" on a receiver of patches only: the first round is the anchor (every
    # element), then only what changed, extracted on the device by the engine's kernel.
    import jax.numpy as jnp

    w = {n: jnp.asarray(a) for n, a in weights().items()}
    source = DictSource(w, describe)
    engine = JAXTrainerEngine.trainer_init(
        TrainerInitInfo(backend="fake_patches", timeouts=FAST, delta="auto"),
        client=server.client(),
        source=source,
    )
    (init,) = server.bodies("init_weight_transfer_engine")
    assert "delta_rounds" not in init["init_info"]  # a stock worker refuses unknown fields
    engine.send_weights()
    info = server.bodies("update_weights")[-1]["update_info"]
    assert info["num_updates_list"] == [24, 4] and "round_token" not in info
    norm = "model.norm.weight"
    source.tensors[norm] = w[norm].at[2].set(7.0)
    engine.send_weights()
    info = server.bodies("update_weights")[-1]["update_info"]
    assert info == {
        "names": [norm],
        "dtype_names": ["float32"],
        "shapes": [[4]],
        "num_updates_list": [1],
    }
    assert BACKEND.comm.broadcasts[-2:] == [
        np.array([2], np.int32).tobytes(),
        np.array([7.0], np.float32).tobytes(),
    ]
    server.fail["finish_weight_update"] = (500, "worker failed at finish")
    source.tensors[norm] = source.tensors[norm].at[0].set(3.0)
    with pytest.raises(Exception, match="worker failed at finish"):
        engine.send_weights()
    del server.fail["finish_weight_update"]
    assert not base_known(engine.session)
    engine.send_weights()  # after a failed round: the anchor again, by itself
    info = server.bodies("update_weights")[-1]["update_info"]
    assert info["num_updates_list"] == [24, 4] and base_known(engine.session)
    with pytest.raises(ConfigError, match="send_patches is for delta='off'"):
        engine.send_patches(anchor(engine))
    engine.shutdown()
