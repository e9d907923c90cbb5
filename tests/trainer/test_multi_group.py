"""Several broadcasters in one NCCL-like group (issue 20), on CPU: threads as trainer
ranks over a ``DictGroup``, a collective fake communicator (``fake_group.FakeWorld``:
a broadcast returns only once every member entered it), fake workers that receive
each turn from its ``src``. What ``weightwire_nccl`` runs on the trainer side, minus cupy.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from tests.trainer.fake_group import FakePacker, FakeWorkers
from tests.trainer.fakes import DictSource, FakeServer
from weightwire.backends.pipelines import DevicePipeline
from weightwire.jax_side.dtypes import describe
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.shared.errors import ConfigError
from weightwire.shared.meta import ParamMeta
from weightwire.shared.owned import OwnedSource
from weightwire.shared.served import ServedModel, ServedModelMismatch
from weightwire.shared.timeouts import Timeouts
from weightwire.trainer.broadcast_plan import PlanError
from weightwire.trainer.config import TrainerInitInfo
from weightwire.trainer.group import DictGroup
from weightwire.trainer.multi_source import RoundFailed
from weightwire.trainer.verify import VerifyError

pytestmark = pytest.mark.timeout(120)

TIMEOUTS = Timeouts(http_s=20, connect_s=10, warmup_s=10, transfer_s=2)
ROUNDS = 3


class FakeDeviceEngine(JAXTrainerEngine):
    def device_packer(self, device: int | None) -> FakePacker:
        return FakePacker()


def model(step: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": rng.standard_normal((16, 8)).astype(np.float32)
    }
    for i in range(3):
        out[f"model.layers.{i}.self_attn.q_proj.weight"] = rng.standard_normal((8, 8)).astype(
            ml_dtypes.bfloat16
        )
        out[f"model.layers.{i}.mlp.up_proj.weight"] = rng.standard_normal((12, 8)).astype(
            np.float32
        )
        out[f"model.layers.{i}.input_layernorm.weight"] = rng.standard_normal((8,)).astype(
            np.float32
        )
    out["model.norm.weight"] = rng.standard_normal((8,)).astype(np.float32)
    out["lm_head.weight"] = rng.integers(-5, 5, (4, 3)).astype(np.int32)
    return {n: (t * (1 + step)).astype(t.dtype) for n, t in out.items()}


def sha(tensors: dict[str, np.ndarray]) -> dict[str, str]:
    return {
        n: hashlib.sha256(np.ascontiguousarray(t).tobytes()).hexdigest() for n, t in tensors.items()
    }


def two(name: str) -> int:
    """Rank 0: embeddings and layer 0; rank 1: the rest."""
    return 0 if "embed" in name or ".layers.0." in name else 1


def three_of_four(name: str) -> int:
    """Ranks 0, 2, 3 broadcast (srcs 0, 1, 2); rank 1 is outside the group."""
    if "embed" in name or ".layers.0." in name:
        return 0
    return 2 if ".layers.1." in name else 3


class Run:
    """``size`` trainer ranks as threads; ``results[r]``: each round's metrics or the error."""

    def __init__(
        self,
        size: int,
        owner: Callable[[str], int],
        *,
        verify: bool = False,
        packed: bool = True,
        inner: Callable[[int, dict[str, np.ndarray]], Any] | None = None,
        owner_of_rank: Callable[[int], Callable[[str], int]] | None = None,
        partial: bool = False,
    ) -> None:
        self.server = FakeServer(world_size=2)
        self.workers = FakeWorkers(self.server)
        self.size, self.owner, self.verify, self.packed = size, owner, verify, packed
        self.partial = partial
        self.inner = inner or (lambda r, tensors: DictSource(tensors, describe))
        self.owner_of_rank = owner_of_rank or (lambda r: owner)
        self.results: list[list[Any]] = [[] for _ in range(size)]
        self.held: list[
            list[dict[str, str]]
        ] = []  # what each worker held after each round (rank 0 reads it)
        self.before_round: Callable[[int], None] = lambda step: None

    def go(self, rounds: int = ROUNDS) -> Run:
        groups = DictGroup.make(self.size)
        start = threading.Barrier(self.size)

        def rank(r: int) -> None:
            tensors = model()
            source = OwnedSource(self.inner(r, tensors), self.owner_of_rank(r), rank=r)
            try:
                cfg = TrainerInitInfo(
                    backend="fake_group",
                    rank=r,
                    pause_mode=None,
                    timeouts=TIMEOUTS,
                    packed=self.packed,
                    packed_buffer_size_bytes=300,
                    verify=self.verify,
                    partial=self.partial,
                )
                engine = FakeDeviceEngine.trainer_init(
                    cfg, client=self.server.client(), source=source, group=groups[r]
                )
            except BaseException as exc:  # recorded per rank
                self.results[r].append(exc)
                return
            for step in range(1, rounds + 1):
                tensors.update(model(step))
                if r == 0:
                    self.before_round(step)
                start.wait(30)
                try:
                    self.results[r].append(engine.send_weights())
                except BaseException as exc:  # recorded per rank
                    self.results[r].append(exc)
                if r == 0:
                    self.held.append([dict(w) for w in self.workers.received])
            engine.shutdown()

        threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(self.size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        assert not any(t.is_alive() for t in threads), "a rank hung"
        return self


@pytest.mark.parametrize(
    ("size", "owner", "packed"),
    [(2, two, True), (2, two, False), (4, three_of_four, True)],
    ids=["2-broadcasters", "2-broadcasters-unpacked", "3-broadcasters-of-4-ranks"],
)
def test_rounds_land_the_unsharded_model_on_every_worker(
    size: int, owner: Callable[[str], int], packed: bool
) -> None:
    run = Run(size, owner, packed=packed).go()
    for r, results in enumerate(run.results):
        assert [m.version for m in results] == ["1", "2", "3"], (r, results)
    for step, held in enumerate(run.held, 1):
        assert held == [sha(model(step))] * 2, f"round {step}"
    groups = sorted({owner(n) for n in model()})
    srcs = list(range(len(groups)))
    updates = [b["update_info"] for b in run.server.bodies("update_weights")]
    assert run.workers.srcs == srcs * ROUNDS  # one update_weights per turn, turns in src order
    assert "src" not in updates[0] and [u.get("src", 0) for u in updates] == srcs * ROUNDS
    assert all(u["names"] for u in updates[: len(srcs)]) and not any(
        u["names"] for u in updates[len(srcs) :]
    )
    assert run.server.bodies("init_weight_transfer_engine")[0]["init_info"]["rank_offset"] == len(
        groups
    )
    assert (
        run.server.bodies("init_weight_transfer_engine")[0]["init_info"]["world_size"]
        == len(groups) + 2
    )
    sent = [m.nbytes for m in run.results[0]]
    assert sent[0] == sum(t.nbytes for n, t in model().items() if owner(n) == 0)
    if size == 4:
        assert all(m.nbytes == 0 for m in run.results[1])  # outside the group: iterates only


class Lockstep(DictSource):
    """Every rank's iteration meets at each tensor (a barrier over all trainer ranks), as
    JAX multi-process gathers or FSDP ``full_tensor`` do: a rank that stops iterating
    while it waits for a broadcast would block every other rank's next gather."""

    def __init__(self, tensors: dict[str, Any], barrier: threading.Barrier) -> None:
        super().__init__(tensors, describe)
        self.barrier = barrier

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for pair in super().__iter__():
            self.barrier.wait(10)  # BrokenBarrierError instead of a hang
            yield pair


def test_rounds_with_collective_gathers_do_not_deadlock() -> None:
    """3 broadcasters of 4 ranks whose sources gather in lockstep: each rank joins the later
    turns' gathers while its driver thread receives those turns."""
    barrier = threading.Barrier(4)
    run = Run(4, three_of_four, inner=lambda r, t: Lockstep(t, barrier)).go()
    for r, results in enumerate(run.results):
        assert [m.version for m in results] == ["1", "2", "3"], (r, results)
    for step, held in enumerate(run.held, 1):
        assert held == [sha(model(step))] * 2, f"round {step}"


def test_a_member_that_skips_a_turn_makes_the_round_time_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fake is a real collective: without the receive-and-drop the members' collectives
    no longer match and the round fails (a broken ``discard`` cannot pass)."""
    monkeypatch.setattr(DevicePipeline, "discard", lambda self, *a, **k: None)
    started = time.monotonic()
    run = Run(2, two).go(rounds=1)
    assert time.monotonic() - started < 30
    for r, (err,) in enumerate(run.results):
        # rank 1 went on to its own turn: its broadcast (root 1) met rank 0's (root 0)
        assert isinstance(err, RoundFailed) and "turn of trainer rank" in str(err), (r, err)
        assert "fake NCCL" in str(err) and (
            "members disagree" in str(err) or "waited 2 s" in str(err)
        ), (r, err)


class Dying(DictSource):
    """Raises after yielding ``after`` tensors (a broadcaster failing mid-turn)."""

    after = 6

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for i, pair in enumerate(super().__iter__()):
            if i == self.after:
                raise ValueError("boom: the gather of this tensor failed")
            yield pair


def test_a_broadcaster_failing_mid_turn_is_named_on_every_rank() -> None:
    """Rank 2 (src 1) raises after its first tensors went out: every rank's error names
    rank 2 and src 1, within the broadcast timeout plus slack; the engines are broken."""
    started = time.monotonic()
    run = Run(
        4,
        three_of_four,
        inner=lambda r, t: Dying(t, describe) if r == 2 else DictSource(t, describe),
    ).go(1)
    elapsed = time.monotonic() - started
    errors = [res[0] for res in run.results]
    for r, err in enumerate(errors):
        assert isinstance(err, RoundFailed), (r, err)
        assert "turn of trainer rank 2 (src 1" in str(err), (r, err)
    assert "rank 2 reported: ValueError: boom" in str(errors[0]), errors[0]
    assert "boom" in str(errors[2]) and "seen by trainer rank 2" in str(errors[2])
    assert "seen by trainer rank 3" in str(errors[3])  # it was receiving rank 2's turn
    assert "trainer rank 0 reported the round failed" in str(errors[1])  # outside the group
    assert elapsed < 4 * TIMEOUTS.transfer_s + 10, elapsed


def test_ranks_disagreeing_on_metadata_fail_before_any_request() -> None:
    run = Run(2, two, owner_of_rank=lambda r: (lambda n: 0) if r == 1 else two).go(1)
    for res in run.results:
        assert isinstance(res[0], PlanError) and "rank(s) [1] differ from rank 0" in str(res[0]), (
            res
        )
    assert "init_weight_transfer_engine" not in run.server.routes()


def test_a_round_that_does_not_fit_the_served_model_fails_on_every_rank_before_any_call() -> None:
    """The server tells a model with a fourth layer: rank 0 raises ``ServedModelMismatch``
    naming it, every other rank a ``PlanError`` naming rank 0; no round call was made."""
    run = Run(2, two)
    extra = ParamMeta("model.layers.3.mlp.up_proj.weight", "float32", (12, 8))
    tensors = [ParamMeta(n, *describe(t)) for n, t in model().items()]
    run.server.served = ServedModel.of([*tensors, extra]).to_dict()
    run.go(1)
    (mismatch,), (plan,) = run.results
    assert isinstance(mismatch, ServedModelMismatch), mismatch
    assert "1 tensor(s) [model.layers.3.mlp.up_proj.weight] of the served model missing" in str(
        mismatch
    )
    assert isinstance(plan, PlanError) and "trainer rank 0: the round does not fit" in str(plan)
    assert "init_weight_transfer_engine" in run.server.routes()
    assert "start_weight_update" not in run.server.routes()


class Forgetful(DictSource):
    def held_names(self) -> set[str] | None:
        return {n for n in self.tensors if n != "lm_head.weight"}


def test_an_orphan_name_is_refused_naming_rank_and_name() -> None:
    run = Run(
        2, two, inner=lambda r, t: Forgetful(t, describe) if r == 1 else DictSource(t, describe)
    ).go(1)
    for res in run.results:
        assert isinstance(res[0], PlanError), res
        assert (
            "trainer rank 1" in str(res[0])
            and "'lm_head.weight'" in str(res[0])
            and "does not hold it" in str(res[0])
        )
    assert "init_weight_transfer_engine" not in run.server.routes()


def test_verify_covers_every_broadcaster_and_names_a_bad_tensors_broadcaster() -> None:
    """verify=True: round 1 passes over every tensor of all 3 slices; in round 2 the
    workers load one of rank 2's tensors wrongly: rank 0 raises a committed VerifyError
    naming the tensor and its broadcaster, the others fail with it; round 3 (fixed) passes."""
    run = Run(4, three_of_four, verify=True)
    bad = "model.layers.1.mlp.up_proj.weight"
    run.before_round = lambda step: setattr(run.workers, "corrupt", bad if step == 2 else None)
    run.go()
    first, second, third = run.results[0]
    assert first.verify.mode == "digest" and first.verify.checked == len(model())
    assert isinstance(second, VerifyError) and second.committed, second
    assert f"{bad!r}: trainer rank 2 (src 1)" in str(second), second
    for r in (1, 2, 3):
        assert isinstance(run.results[r][1], RoundFailed) and bad in str(run.results[r][1])
        assert (
            run.results[r][2].version == "3"
        )  # a committed round whose check failed breaks nothing
    assert third.verify.checked == len(model())


def test_weightwire_nccl_hands_the_other_broadcasters_only_the_join_fields() -> None:
    """The real backend's group hooks, as far as they run without cupy: the peer fields
    are the unique id and the group's world size, and joining needs NCCL on that rank."""
    from weightwire.backends import get_backend
    from weightwire.backends.nccl.library import nccl_available

    backend = get_backend("weightwire_nccl")
    payload = {
        "nccl_unique_id_b64": "A" * 172,
        "world_size": 5,
        "rank_offset": 3,
        "packed": True,
        "timeout_s": 9.0,
    }
    assert backend.peer_fields(payload) == {"nccl_unique_id_b64": "A" * 172, "world_size": 5}
    if not nccl_available():
        with pytest.raises(
            RuntimeError, match="needs cupy with NCCL and a CUDA device on every broadcasting rank"
        ):
            backend.join_peer(
                TrainerInitInfo(backend="weightwire_nccl"),
                backend.peer_fields(payload),
                rank=1,
                timeout=1,
            )
    with pytest.raises(NotImplementedError, match="no shared group"):
        get_backend("weightwire_tcp").peer_fields(payload)


class Emptied(DictSource):
    """Lists no tensors once ``EMPTIED`` is set (after the init): a round of none."""

    def metadata(self) -> list[ParamMeta]:
        return [] if EMPTIED[self.rank] else super().metadata()

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(()) if EMPTIED[self.rank] else super().__iter__()

    rank = 0


EMPTIED = [False] * 4


def _emptied(ranks: set[int]) -> Callable[[int, dict[str, np.ndarray]], Any]:
    def inner(r: int, tensors: dict[str, np.ndarray]) -> DictSource:
        src = Emptied(tensors, describe)
        src.rank = r
        return src

    EMPTIED[:] = [False] * 4

    def before_round(step: int) -> None:
        for r in ranks:
            EMPTIED[r] = True

    inner.before_round = before_round  # type: ignore[attr-defined]
    return inner


def one(name: str) -> int:
    """Rank 0 broadcasts every tensor: a group of one broadcaster (its sole round)."""
    return 0


@pytest.mark.parametrize("owner", [one, two], ids=["1-broadcaster", "2-broadcasters"])
@pytest.mark.parametrize("empty", [{0, 1}, {0}, {1}], ids=["every-rank", "rank-0", "rank-1"])
def test_a_round_of_no_tensors_is_refused_on_every_rank_before_any_call(
    empty: set[int], owner: Callable[[str], int]
) -> None:
    """A group round whose source lists no tensors (``partial=True``, so no tensor counts as
    missing): every rank raises ``ConfigError`` naming it, at once, and no round call was
    made (its update info, listing none, would read as the previous round's on the workers:
    with one broadcaster rank 0 sent it and the workers waited for bytes)."""
    inner = _emptied(empty)
    run = Run(2, owner, inner=inner, partial=True)
    run.before_round = inner.before_round  # type: ignore[attr-defined]
    began = time.monotonic()
    run.go(1)
    elapsed = time.monotonic() - began
    for r, (res,) in enumerate(run.results):
        assert isinstance(res, ConfigError), (r, res)
        assert "a round of no tensors cannot be sent" in str(res), res
        assert f"(on trainer rank(s) {sorted(empty)})" in str(res), res
    assert "start_weight_update" not in run.server.routes()
    assert "update_weights" not in run.server.routes()
    assert elapsed < TIMEOUTS.http_s, elapsed
