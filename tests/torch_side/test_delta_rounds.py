"""Delta rounds on the worker: any sequence of dense and delta rounds leaves every worker
kind holding exactly the trainer's bytes; a delta on a base the worker does not hold is
refused before any byte; a failed round applies none of its patches (``_delta`` explains
the trainer, the link and the worker kinds)."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.torch_side._delta import (
    LAYOUT,
    WORKERS,
    Session,
    Trainer,
    Wire,
    assert_holds,
    host_bytes,
    make_worker,
)
from weightwire.shared.errors import DeltaBaseMismatch, PeerLost
from weightwire.shared.update_info import UpdateInfo
from weightwire.torch_side.worker.core import WeightReceiveError
from weightwire.torch_side.worker.engines import watch_sleep

pytestmark = pytest.mark.timeout(120)

DENSITIES = st.sampled_from([0.0, 0.0, 0.01, 0.05, 0.2, 0.5, 1.0])
ROUND = st.tuples(
    st.sampled_from([True, True, True, False]),  # a delta round (likelier) or a dense one
    st.fixed_dictionaries({name: DENSITIES for name, _, _ in LAYOUT}),
    st.sampled_from([0.0, 0.3, 1.0]),  # the density threshold: all dense .. all patched
)


@pytest.mark.parametrize("budget", [1 << 30, 0], ids=["staged", "streaming"])
@pytest.mark.parametrize("kind", WORKERS)
@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(rounds=st.lists(ROUND, min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_any_round_sequence_lands_bit_exact(
    kind: str, budget: int, rounds: list, seed: int
) -> None:
    """Staged rounds, and rounds applied in place as they land (stage budget 0): patches
    still wait for finish, after the dense tensors."""
    worker = make_worker(kind)
    trainer = Trainer(seed)
    session = Session(worker.engine, delta_rounds=True, stage_budget_bytes=budget)
    try:
        session.anchor(trainer)
        assert_holds(worker, trainer.weights)
        for delta, densities, threshold in rounds:
            trainer.step(densities)
            wire = trainer.encode(dense=not delta, threshold=threshold)
            session.send(wire)
            trainer.committed(wire)
            assert_holds(worker, trainer.weights)
    finally:
        session.close()
    assert session.sender.error is None
    if worker.framework is not None:
        assert worker.framework.violations == []
    maps = [m.map for m in worker.engine._core.caches.loader_maps.values()]
    assert any(m is not None for m in maps) == (kind in ("map", "map_whole", "landing"))
    copy = worker.engine._core.weights.host_copy(worker.net).nbytes
    # Only the fallback keeps a host copy: one copy of the checkpoint tensors.
    assert copy == (sum(a.nbytes for a in trainer.weights.values()) if "copy" in kind else 0)


def test_patches_only_touch_changed_elements_and_skip_the_reload() -> None:
    """A round of patches alone on a loader-map worker writes only through the map: the
    framework's (whole-layer) reload does not run for it."""
    worker = make_worker("map_whole")
    trainer = Trainer(3)
    session = Session(worker.engine, delta_rounds=True)
    try:
        first = session.anchor(trainer)
        reloads = worker.framework.reloads  # type: ignore[union-attr]
        trainer.step({"model.layers.0.proj.weight": 0.05, "model.norm.weight": 0.2})
        wire = trainer.encode(dense=False, threshold=0.5)
        assert wire.info.patches is not None and len(wire.info.patches) == 2
        assert wire.nbytes < first.nbytes / 10
        session.send(wire)
        assert worker.framework.reloads == reloads  # type: ignore[union-attr]
        assert_holds(worker, trainer.weights)
    finally:
        session.close()


@pytest.mark.parametrize("kind", ["hf_host", "map", "copy"])
def test_a_delta_on_a_base_the_worker_does_not_hold_is_refused_before_any_byte(
    kind: str,
) -> None:
    worker = make_worker(kind)
    trainer = Trainer(5)
    session = Session(worker.engine, delta_rounds=True)
    session.anchor(trainer)
    before = {n: host_bytes(p) for n, p in worker.params.items()}
    trainer.step({"model.layers.1.proj.weight": 0.1})
    trainer.base_token = "other:7"  # the trainer believes the worker holds another round
    wire = trainer.encode(dense=False)
    session._queue.put(wire)
    worker.engine.start_weight_update()
    with pytest.raises(DeltaBaseMismatch) as refused:
        worker.engine.update_weights(wire.info.to_dict())
    assert str(refused.value) == (
        "DeltaBaseMismatch: the round's patches were built on round 'other:7' but this worker "
        "holds round 't:1'; send the round dense"
    )
    # The link was aborted at once: the sender's next bytes meet a closed link (not a
    # timeout), so a trainer learns of the refusal on the data plane too.
    session._queue.put(wire)
    session.sender.join()
    assert isinstance(session.sender.error, PeerLost), session.sender.error
    assert {n: host_bytes(p) for n, p in worker.params.items()} == before
    worker.engine.shutdown()


def test_a_worker_that_cannot_patch_refuses_a_delta_naming_why() -> None:
    """No loader map and delta rounds off: no host copy was kept, so the worker refuses."""
    worker = make_worker("copy")
    trainer = Trainer(6)
    session = Session(worker.engine)  # the trainer declared no delta rounds
    session.anchor(trainer)
    trainer.step({"model.norm.weight": 0.2})
    wire = trainer.encode(dense=False)
    session._queue.put(wire)
    worker.engine.start_weight_update()
    with pytest.raises(DeltaBaseMismatch, match="holds round 't:1'; send the round dense") as exc:
        worker.engine.update_weights(wire.info.to_dict())
    assert "delta rounds are off on this worker" in str(exc.value)
    session._queue.put(wire)
    session.sender.join()
    worker.engine.shutdown()


@pytest.mark.parametrize("kind", ["hf_host", "map", "copy_whole"])
def test_a_failed_round_applies_none_of_its_patches_and_forgets_the_base(kind: str) -> None:
    worker = make_worker(kind)
    trainer = Trainer(7)
    session = Session(worker.engine, delta_rounds=True)
    session.anchor(trainer)
    before = {n: host_bytes(p) for n, p in worker.params.items()}
    trainer.step({n: 0.05 for n, _, _ in LAYOUT})
    wire = trainer.encode(dense=False, threshold=1.0)
    wire.arrays[-1] = wire.arrays[-1][:-1]  # the last patch's values arrive one short
    wire.info = type(wire.info).from_dict(wire.info.to_dict())
    session._queue.put(wire)
    worker.engine.start_weight_update()
    with pytest.raises(Exception):  # noqa: B017  (the sender dies mid-round: any receive error)
        worker.engine.update_weights(wire.info.to_dict())
    session.sender.join()
    assert {n: host_bytes(p) for n, p in worker.params.items()} == before
    # The base is forgotten: a retry of the delta is refused, a dense round lands.
    retry = Session(worker.engine, delta_rounds=True)
    trainer.round -= 1
    again = trainer.encode(dense=False, threshold=1.0)
    retry._queue.put(again)
    worker.engine.start_weight_update()
    with pytest.raises(DeltaBaseMismatch, match="holds round None"):
        worker.engine.update_weights(again.info.to_dict())
    retry._queue.put(again)
    retry.sender.join()
    trainer.failed()
    final = Session(worker.engine, delta_rounds=True)
    dense = trainer.encode(dense=True)
    final.send(dense)
    assert_holds(worker, trainer.weights)
    final.close()


def test_a_round_without_a_token_and_a_non_delta_init_forget_the_base() -> None:
    worker = make_worker("hf_host")
    trainer = Trainer(8)
    session = Session(worker.engine, delta_rounds=True)
    first = trainer.encode(dense=True)
    session.send(first)
    assert worker.engine._core.weights.token(worker.engine.model) == "t:1"
    plain = trainer.encode(dense=True)
    plain.info = type(plain.info)(
        names=plain.info.names, dtype_names=plain.info.dtype_names, shapes=plain.info.shapes
    )
    session.send(plain)  # a trainer that sends no token
    assert worker.engine._core.weights.token(worker.engine.model) is None
    third = trainer.encode(dense=True)
    session.send(third)
    assert worker.engine._core.weights.token(worker.engine.model) == "t:3"
    session.close()
    other = Session(worker.engine)  # another trainer, without delta rounds
    assert worker.engine._core.weights.token(worker.engine.model) is None
    other.close()


def test_reference_server_checksums_cover_patched_tensors_whole() -> None:
    """``verify=True`` on the reference server: its checksums are over the parameters, so a
    patched tensor's checksum is that of its full new value (what the trainer digests)."""
    worker = make_worker("hf_host")
    trainer = Trainer(9)
    session = Session(worker.engine, delta_rounds=True)
    session.anchor(trainer)
    trainer.step({"model.layers.0.mlp.experts.w13": 0.01})
    wire = trainer.encode(dense=False)
    assert wire.info.patches and wire.info.patches[0][0] == "model.layers.0.mlp.experts.w13"
    session._queue.put(wire)
    worker.engine.start_weight_update()
    worker.engine.update_weights(wire.info.to_dict())
    # Held until finish, where the server's --check-finite sees the values too.
    held = dict(worker.engine.held_tensors())
    assert host_bytes(held["model.layers.0.mlp.experts.w13@values"]) == wire.arrays[1].tobytes()
    worker.engine.finish_weight_update()
    session.close()
    sums = worker.engine.model.state_checksums()
    for name, array in trainer.weights.items():
        assert sums[name] == hashlib.sha256(array.tobytes()).hexdigest(), name


def test_reusing_a_delta_rounds_metadata_is_refused_before_any_byte() -> None:
    """vLLM 0.33's "empty lists = the previous metadata" cannot stand for a delta round: its
    patches would arrive undescribed (loaded as tensors named ``T@index``)."""
    worker = make_worker("hf_host")
    trainer = Trainer(10)
    session = Session(worker.engine, delta_rounds=True)
    session.anchor(trainer)
    trainer.step({"model.norm.weight": 0.2})
    wire = trainer.encode(dense=False)
    session.send(wire)
    trainer.committed(wire)
    before = {n: host_bytes(p) for n, p in worker.params.items()}
    session._queue.put(wire)
    worker.engine.start_weight_update()
    with pytest.raises(ValueError, match="a delta round's patches must be described in full"):
        worker.engine.update_weights({"round_token": "t:9"})  # names/dtypes/shapes left out
    session._queue.put(wire)
    session.sender.join()
    assert {n: host_bytes(p) for n, p in worker.params.items()} == before
    worker.engine.shutdown()


def _wire_pair(wire: Wire, name: str) -> int:
    """Where ``name``'s ``@index`` wire tensor is (its ``@values`` follows)."""
    return wire.info.names.index(f"{name}@index")


@pytest.mark.parametrize("budget", [1 << 30, 0], ids=["staged", "streaming"])
@pytest.mark.parametrize("kind", ["hf_host", "map", "copy"])
@pytest.mark.parametrize("fault", ["unsorted", "repeated"])
def test_patch_indices_not_strictly_increasing_are_refused_before_any_write(
    kind: str, budget: int, fault: str
) -> None:
    """The wire's rule, checked with the range in one pass: an unsorted or repeated index
    (two values for one element: the last wins on a CPU, any on a GPU) fails the round
    naming the tensor, and nothing of it lands."""
    worker = make_worker(kind)
    trainer = Trainer(11)
    session = Session(worker.engine, delta_rounds=True, stage_budget_bytes=budget)
    session.anchor(trainer)
    before = {n: host_bytes(p) for n, p in worker.params.items()}
    name = "model.layers.0.proj.weight"
    trainer.step({name: 0.2, "model.norm.weight": 1.0})  # the norm goes dense
    wire = trainer.encode(dense=False, threshold=0.5)
    i = _wire_pair(wire, name)
    index, values = wire.arrays[i], wire.arrays[i + 1]
    if fault == "unsorted":
        wire.arrays[i], wire.arrays[i + 1] = index[::-1].copy(), values[::-1].copy()
        want = f"index {index[-2]} at position 1 follows {index[-1]}"
    else:
        wire.arrays[i] = index = index.copy()
        index[1] = index[0]
        want = f"index {index[0]} at position 1 follows {index[0]}"
    session._queue.put(wire)
    worker.engine.start_weight_update()
    with pytest.raises(WeightReceiveError) as failed:
        worker.engine.update_weights(wire.info.to_dict())
    assert f"patch of {name!r}: indices must be strictly increasing, but {want}" in str(
        failed.value
    )
    session.close()
    after = {n: host_bytes(p) for n, p in worker.params.items()}
    if budget:
        assert after == before
    else:  # in place: the dense norm landed, no patch did
        assert {n: b for n, b in after.items() if n != "model.norm.weight"} == {
            n: b for n, b in before.items() if n != "model.norm.weight"
        }
        assert worker.engine.incomplete_round is not None


def _with_tied_patch(wire: Wire, embed: str, values: np.ndarray) -> Wire:
    """``wire`` with a patch of ``lm_head.weight`` (tied to ``embed``) at ``embed``'s indices."""
    i = _wire_pair(wire, embed)
    info = wire.info
    entry = next(p for p in info.patches or [] if p[0] == embed)
    head = ["lm_head.weight", *entry[1:]]
    return Wire(
        [*wire.arrays, wire.arrays[i].copy(), values],
        UpdateInfo(
            names=[*info.names, "lm_head.weight@index", "lm_head.weight@values"],
            dtype_names=[*info.dtype_names, info.dtype_names[i], info.dtype_names[i + 1]],
            shapes=[*info.shapes, info.shapes[i], info.shapes[i + 1]],
            round_token=info.round_token,
            delta_base=info.delta_base,
            patches=[*(info.patches or []), head],
        ),
    )


@pytest.mark.parametrize("budget", [1 << 30, 0], ids=["staged", "streaming"])
@pytest.mark.parametrize("kind", ["hf_host", "map"])
def test_both_names_of_a_tied_tensor_patched_differently_are_refused(
    kind: str, budget: int
) -> None:
    """``lm_head.weight`` is ``model.embed_tokens.weight``: patches of both names with
    different values are refused as the same conflict sent dense is; the same values land."""
    embed = "model.embed_tokens.weight"
    worker = make_worker(kind)
    trainer = Trainer(12)
    session = Session(worker.engine, delta_rounds=True, stage_budget_bytes=budget)
    session.anchor(trainer)
    before = {n: host_bytes(p) for n, p in worker.params.items()}
    trainer.step({embed: 0.05})
    wire = trainer.encode(dense=False, threshold=1.0)
    values = wire.arrays[_wire_pair(wire, embed) + 1]
    other = (values.astype(np.float32) + 1).astype(values.dtype)
    conflict = _with_tied_patch(wire, embed, other)
    session._queue.put(conflict)
    worker.engine.start_weight_update()
    with pytest.raises(WeightReceiveError) as failed:
        worker.engine.update_weights(conflict.info.to_dict())
    assert (
        f"'lm_head.weight' received twice in one round with different values: it is tied to "
        f"{embed!r}" in str(failed.value)
    )
    session.close()
    assert {n: host_bytes(p) for n, p in worker.params.items()} == before

    agreeing = Session(worker.engine, delta_rounds=True, stage_budget_bytes=budget)
    trainer.failed()
    agreeing.anchor(trainer)
    trainer.step({embed: 0.05})
    wire = trainer.encode(dense=False, threshold=1.0)
    same = _with_tied_patch(wire, embed, wire.arrays[_wire_pair(wire, embed) + 1].copy())
    agreeing.send(same)
    assert_holds(worker, trainer.weights)
    agreeing.close()


class _SleepyWorker:
    """vLLM's worker as far as sleep goes: ``collective_rpc("sleep", level)`` calls this."""

    def __init__(self) -> None:
        self.slept: list[int] = []

    def sleep(self, level: int = 1) -> None:
        self.slept.append(level)


@pytest.mark.parametrize("kind", ["map", "copy"])
def test_a_vllm_workers_sleep_level_2_forgets_the_delta_base(kind: str) -> None:
    """The vLLM engine watches its worker's sleep (``watch_sleep``): level 1 keeps the
    weights and the base; level 2 discards them, so a delta round on the last committed
    round is refused before any byte, in the same session."""
    worker = make_worker(kind)
    trainer = Trainer(13)
    session = Session(worker.engine, delta_rounds=True)
    session.anchor(trainer)
    host = _SleepyWorker()
    watch_sleep(host, worker.engine)
    watch_sleep(host, worker.engine)  # a second init watches nothing twice
    host.sleep(1)
    assert worker.engine._core.weights.token(worker.net) == "t:1"
    host.sleep(level=2)
    assert host.slept == [1, 2]
    assert worker.engine._core.weights.token(worker.net) is None
    assert worker.engine._core.weights.host_copy(worker.net).nbytes == 0
    before = {n: host_bytes(p) for n, p in worker.params.items()}
    trainer.step({"model.layers.1.proj.weight": 0.1})
    wire = trainer.encode(dense=False)
    session._queue.put(wire)
    worker.engine.start_weight_update()
    with pytest.raises(
        DeltaBaseMismatch, match="built on round 't:1' but this worker holds round None"
    ):
        worker.engine.update_weights(wire.info.to_dict())
    session._queue.put(wire)
    session.sender.join()
    assert {n: host_bytes(p) for n, p in worker.params.items()} == before
    worker.engine.shutdown()
