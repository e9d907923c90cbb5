"""Sliced rounds in combination (issue #48): a trainer engine and in-process TCP workers
hosting ``SlicedTP`` ranks (TP 2, one KV head on both, tied head), each round sliced, in
combination with sleep / wake and weight resets between rounds, overlapped rounds, the
stage budget (pause and round guard), a failure in every phase, adapters, and wants that do
not fit the trainer's tensors. After each committed round every worker's parameters equal
``load_weights`` of the full tensors bit for bit; after each failed one, the previous
round's exactly; the round after a failure succeeds."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch

from tests.trainer._sliced_session import (
    TP2,
    as_source,
    assert_kept,
    assert_loaded,
    changed,
    committed_round,
    cut_link_at,
    fails_keeping,
    full_tensors,
    info,
    lands_sliced,
    opened,
    params,
    put,
    torch_engine,
)
from tests.trainer._sliced_workers import TPClient, expected, spec_of
from weightwire.shared.errors import WeightwireError
from weightwire.tools.server.sleep import ModelSleeper
from weightwire.vllm_guard.worker import worker_round_state


def load(tensors: dict[str, Any], step: int) -> dict[str, np.ndarray]:
    """The round ``step``'s full tensors, put in the trainer's source (``tensors``)."""
    full = full_tensors(TP2, step)
    put(tensors, full)
    return full


def again(engine: Any, client: TPClient, tensors: dict[str, Any], **kw: Any) -> Any:
    """After a round that failed mid-transfer the engine is ``EngineBroken`` (as for any
    round, ``docs/reliability.md``): ``shutdown()`` and ``trainer_init()`` again, on the same
    workers (each drops what the failed round left open: its trainer's link is closed)."""
    from weightwire.trainer.engine import EngineBroken

    with pytest.raises(EngineBroken, match=r"trainer_init\(\) again"):
        engine.send_weights()
    engine.shutdown()
    return torch_engine(client, tensors, **kw)


def lands_after_reinit(
    engine: Any, client: TPClient, tensors: dict[str, Any], *, overlapped: bool = False
) -> Any:
    """``again``, then round 3 (``overlapped``: ``wait=False``) is sliced and lands whole;
    the new engine."""
    engine = again(engine, client, tensors)
    if overlapped:
        full = load(tensors, 3)
        engine.send_weights(wait=False).result(timeout=60)
        assert client.last_update["sliced"] is True
        assert_loaded(client, full)
    else:
        lands_sliced(engine, client, tensors, 3)
    return engine


def state(client: TPClient) -> list[dict[str, Any]]:
    """What the round guard asks each worker (``vllm_guard.worker``): are its weights whole."""
    return [
        worker_round_state(type("Worker", (), {"weight_transfer_engine": e})())
        for e in client.engines
    ]


# ------------------------------------------------------------------ 1. sleep, wake, reset


def sleep_and_wake(client: TPClient, level: int) -> None:
    """Each worker sleeps through the hook the plugin installs on vLLM's worker
    (``engines.watch_sleep``: at level 2 the engine is told its weights are gone), the
    sleep itself the reference server's (``ModelSleeper``), then wakes: level 1 keeps the
    weights, level 2 wakes them zeroed in fresh storage."""
    from types import SimpleNamespace

    from weightwire.torch_side.worker.engines import watch_sleep

    for model, engine in zip(client.models, client.engines, strict=True):
        sleeper = ModelSleeper(model, torch.device("cpu"))
        worker = SimpleNamespace(sleep=sleeper.sleep)
        watch_sleep(worker, engine)
        worker.sleep(level)
        assert sleeper.wake(None)


def reset(client: TPClient, value: float = 0.0) -> None:
    """A reset of the weights outside a round (``/weight_checker`` reset: zeroed in place;
    NaN: what a level-2 wake that does not zero leaves, vLLM's memory as it comes)."""
    for model, engine in zip(client.models, client.engines, strict=True):
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(value)
        engine.weights_changed("reset the weights")


@pytest.mark.parametrize("budget", [1 << 30, 0], ids=["staged", "in-place"])
@pytest.mark.parametrize("mapped", [True, False], ids=["landing-map", "load_weights"])
def test_sleep_wake_and_reset_between_sliced_rounds(budget: int, mapped: bool) -> None:
    """Level 1, level 2 + wake (zeroed, reallocated), a reset in place, and a level 2 whose
    wake leaves garbage (NaN: every element, the padding's constant fill too, must be
    written again) between rounds: each next round is sliced and lands whole, whether
    through the landing map (re-recorded for the reallocated parameters) or, for a worker
    without one, through ``load_weights``."""
    client = TPClient(TP2)
    if not mapped:  # worker 1 processes its weights after loading: no map to write through
        client.models[1].qkv_proj.quant_method = object()
    tensors: dict[str, Any] = {}
    with opened(client, tensors, stage_budget_bytes=budget) as engine:
        load(tensors, 1)
        engine.send_weights()
        caches = client.engines[1]._core.caches
        assert [m.map is not None for m in caches.loader_maps.values()] == [mapped]
        # what it records of its loader's reads holds no parameter (a sleep frees them)
        assert all(not m.map.params for m in caches.reads_maps.values() if m.map)
        assert len(caches.reads_maps) == (0 if mapped else 1)
        between = [
            lambda: sleep_and_wake(client, 1),
            lambda: sleep_and_wake(client, 2),
            lambda: reset(client),
            lambda: (sleep_and_wake(client, 2), reset(client, float("nan"))),
        ]
        for step, change in enumerate(between, start=2):
            change()
            if step == 3:  # level 2 woke the weights zeroed, in new storage
                assert all(not p.any() for p in client.params(0).values())
            full = load(tensors, step)
            engine.send_weights()
            assert client.last_update["sliced"] is True
            assert_loaded(client, full)


@pytest.mark.parametrize("delta", [False, True], ids=["dense", "delta"])
@pytest.mark.parametrize("budget", [1 << 30, 0], ids=["staged", "in-place"])
@pytest.mark.parametrize("change", ["sleep-2", "reset"])
def test_a_sleep_or_reset_between_a_sliced_rounds_update_and_finish_fails_the_round(
    change: str, budget: int, delta: bool
) -> None:
    """A level-2 sleep (and wake) or a reset of the weights on both workers after the
    round's update and before its finish: the round fails at its finish, naming the change,
    and applies nothing more (what it held was for the weights that went: a delta round's
    patches over the zeroed weights, a staged round's pieces through a landing map of the
    freed parameters); a round written in place leaves the model incomplete; after the
    re-init the next round lands whole. Was: it committed, the workers served wrong weights
    (zeros and patches; the landing map's old storage) and adopted its token as a base."""
    client = TPClient(TP2)
    tensors: dict[str, Any] = {}
    kw: dict[str, Any] = {"stage_budget_bytes": budget, "delta": "auto" if delta else "off"}
    engine = torch_engine(client, tensors, **kw)
    try:
        full = load(tensors, 1)
        engine.send_weights()
        put(tensors, changed(full, 2))

        def meanwhile() -> None:
            client.before_finish = None
            sleep_and_wake(client, 2) if change == "sleep-2" else reset(client)

        client.before_finish = meanwhile
        what = "sleep level 2 discards the weights" if change == "sleep-2" else "reset the weights"
        said = rf"aborted before its finish \(the weights changed while it was open: {what}\)"
        with pytest.raises(WeightwireError, match=said):
            engine.send_weights()
        assert [s["whole"] for s in state(client)] == [budget > 0] * 2
        engine = again(engine, client, tensors, **kw)
        full = load(tensors, 3)
        engine.send_weights()
        assert client.last_update["sliced"] is True and "patches" not in client.last_update
        assert_loaded(client, full)
        assert [s["whole"] for s in state(client)] == [True, True]
    finally:
        engine.shutdown()
        client.close()


# ------------------------------------------------------------------ 2. overlapped rounds


def test_overlapped_sliced_rounds_snapshot_and_fail_on_their_own_round() -> None:
    """``send_weights(wait=False)`` on a sliced session: the round is sliced and sends the
    snapshot taken at the call (the tensors written right after it do not leak in); a round
    whose link drops fails on its own handle, not a round late, leaving every worker on the
    previous round exactly; after the engine's re-init the next overlapped round lands whole."""
    client = TPClient(TP2)
    tensors: dict[str, Any] = {}
    engine = torch_engine(client, tensors)
    try:
        full = load(tensors, 1)
        handle = engine.send_weights(wait=False)
        for t in tensors.values():  # the trainer's next step writes its weights in place
            t.add_(1.0)
        handle.result(timeout=60)
        assert client.last_update["sliced"] is True
        assert_loaded(client, full)
        before = params(client)

        cut_link_at(engine, worker=1, read=10)
        load(tensors, 2)
        failed = engine.send_weights(wait=False)
        with pytest.raises(WeightwireError, match="lost|closed|reset|Broken|PeerLost"):
            failed.result(timeout=60)
        assert_kept(client, before)
        engine = lands_after_reinit(engine, client, tensors, overlapped=True)
    finally:
        engine.shutdown()
        client.close()


def test_overlapped_jax_sliced_rounds_send_their_snapshot() -> None:
    """A JAX trainer's overlapped rounds (``PytreeSource``: its snapshot references the
    arrays of the call) on a sliced session: sliced, read from the snapshot where it is held
    (``sharded``, as a blocking round reads it: never gathered; ``_sliced_jax_trainer``
    checks that on a mesh), and the params replaced right after the call do not leak in."""
    from weightwire.jax_side.engine import JAXTrainerEngine
    from weightwire.jax_side.naming import Naming
    from weightwire.jax_side.rules import Rule
    from weightwire.jax_side.source import PytreeSource

    client = TPClient(TP2)
    arrays: dict[str, Any] = {}

    def put_step(step: int) -> dict[str, np.ndarray]:
        full = full_tensors(TP2, step)
        put(arrays, full, "jax")
        return full

    put_step(0)
    source = PytreeSource(lambda: dict(arrays), Naming([Rule("{x}", "{x}")]))
    sharded, reads = PytreeSource.sharded, []

    def watched(self: PytreeSource) -> PytreeSource:
        reads.append(1)
        return sharded(self)

    engine = JAXTrainerEngine.trainer_init(info(), client=client, source=source)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(PytreeSource, "sharded", watched)
            for step in (1, 2):
                full = put_step(step)
                handle = engine.send_weights(wait=False)
                put_step(step + 10)  # the trainer's next step
                handle.result(timeout=60)
                assert client.last_update["sliced"] is True
                assert_loaded(client, full)
        assert len(reads) == 2
    finally:
        engine.shutdown()
        client.close()


# ------------------------------------------------------------------ 3. stage budget, pause, guard


class GuardClient(TPClient):
    """``TPClient`` with a pause and a round guard that records what the trainer asked; its
    release refuses while a worker's weights are not whole (``vllm_guard``'s rule)."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.calls: list[str] = []
        self.held = False

    def pause(self, mode: str = "keep") -> None:
        self.calls.append(f"pause:{mode}")

    def resume(self) -> None:
        self.calls.append("resume")

    def round_guard(self) -> list[dict[str, Any]]:
        return [{"guard": "weightwire", "covers": True}]

    def hold_round(self, round_id: str, session: str | None = None) -> None:
        self.calls.append("hold")
        self.held = True

    def release_round(self, *, resume: bool = True) -> None:
        from weightwire.shared.errors import WeightSyncError

        broken = [s["reason"] for s in state(self) if not s["whole"]]
        if broken:
            self.calls.append("release refused")
            raise WeightSyncError(
                "/weightwire/round_guard/release", 409, f"weights not whole: {broken}", "tp"
            )
        self.calls.append("release+resume" if resume else "release")
        self.held = False


PAUSES = {  # pause_mode -> (the calls within the budget, over it)
    "auto": ([], ["hold", "pause:abort", "resume", "release"]),
    "keep": (["pause:keep", "resume"], ["hold", "pause:abort", "resume", "release"]),
    "abort": (["pause:abort", "resume"], ["hold", "pause:abort", "resume", "release"]),
    "wait": (["pause:wait", "resume"], ["hold", "pause:wait", "resume", "release"]),
    None: ([], []),
}


@pytest.mark.parametrize("mode", list(PAUSES), ids=str)
def test_every_pause_mode_treats_a_sliced_round_by_where_it_lands(mode: str | None) -> None:
    """Each ``pause_mode`` pauses a sliced round within the stage budget as a staged round
    (its own mode, ``auto``: none) and one over it as a round applied in place (the guard
    held, ``abort`` for ``auto`` / ``keep``); ``None`` never pauses."""
    for budget, want in zip((1 << 30, 0), PAUSES[mode], strict=True):
        client = GuardClient(TP2)
        tensors: dict[str, Any] = {}
        with opened(client, tensors, pause_mode=mode, stage_budget_bytes=budget) as engine:
            full = load(tensors, 1)
            engine.send_weights()
            assert client.last_update["sliced"] is True
            assert client.calls == want, budget
            assert_loaded(client, full)


def test_a_sliced_round_within_the_budget_is_staged_and_applied_at_finish() -> None:
    """Within ``stage_budget_bytes`` each worker holds its pieces until the commit: before
    the finish the model is unchanged and whole (the guard would let requests through), the
    round is paused as a whole (``pause_mode``'s own mode, resumed after), no guard."""
    client = GuardClient(TP2)
    tensors: dict[str, Any] = {}
    with opened(client, tensors, pause_mode="keep", stage_budget_bytes=1 << 30) as engine:
        _, before = committed_round(engine, client, tensors)
        at_finish: list[Any] = []

        def look() -> None:
            assert_kept(client, before)  # nothing written yet
            at_finish.append(([e.round_strategy for e in client.engines], state(client)))

        client.before_finish = look
        client.calls.clear()
        full = load(tensors, 2)
        engine.send_weights()
        assert_loaded(client, full)
        strategies, states = at_finish[0]
        assert strategies == ["sliced", "sliced"] and all(s["whole"] for s in states)
        assert client.calls == ["pause:keep", "resume"]


def test_a_sliced_round_over_the_budget_lands_in_place_under_the_guard() -> None:
    """Over ``stage_budget_bytes`` each piece is written as it lands: the trainer pauses with
    ``abort`` and holds the round guard, the guard sees a round applied in place until the
    commit. A round in place whose link drops leaves the workers incomplete: the guard keeps
    refusing (no resume), the next complete round lifts it."""
    client = GuardClient(TP2)
    tensors: dict[str, Any] = {}
    engine = torch_engine(client, tensors, pause_mode="auto", stage_budget_bytes=0)
    at_finish: list[Any] = []
    client.before_finish = lambda: at_finish.append(
        ([e.round_strategy for e in client.engines], state(client))
    )
    try:
        full = load(tensors, 1)
        engine.send_weights()
        assert_loaded(client, full)
        strategies, states = at_finish[0]
        assert strategies == ["sliced_in_place"] * 2
        assert [s["whole"] for s in states] == [False, False]
        assert "applied in place" in states[0]["reason"]
        assert client.calls == ["hold", "pause:abort", "resume", "release"]

        cut_link_at(engine, worker=1, read=10)
        client.calls.clear()
        load(tensors, 2)
        with pytest.raises(WeightwireError):
            engine.send_weights()
        assert "resume" not in client.calls and client.calls[-1] == "release refused"
        assert client.held
        incomplete = [e.incomplete_round for e in client.engines if e.incomplete_round]
        assert incomplete and all("sliced round ended" in i.reason for i in incomplete)

        engine = again(engine, client, tensors, pause_mode="auto", stage_budget_bytes=0)
        client.calls.clear()
        full = load(tensors, 3)
        engine.send_weights()
        assert_loaded(client, full)
        assert [e.incomplete_round for e in client.engines] == [None, None]
        assert not client.held and client.calls[-2:] == ["resume", "release"]
    finally:
        engine.shutdown()
        client.close()


# ------------------------------------------------------------------ 4. failure in every phase


def shifted(real: Any, worker: int) -> Any:
    """``trainer.sliced.pieces`` whose first piece for ``worker`` (rank 0: the embedding's
    rows 0:6 of 11) is moved one row down: a box inside the tensor, outside what that worker
    wants (its last row is the next rank's)."""
    from weightwire.backends.base import SlicePiece
    from weightwire.shared.slices import Box

    def pieces(*args: Any, **kw: Any) -> Any:
        moved = False
        for group in real(*args, **kw):
            out = []
            for p in group:
                if not moved and p.worker == worker:
                    (lo, hi), *rest = p.box.ranges
                    box = Box(((lo + 1, hi + 1), *rest))
                    read = functools.partial(p.read.func, p.read.args[0], box)
                    p, moved = SlicePiece(p.worker, p.tensor, box, read), True
                out.append(p)
            yield out

    return pieces


def dropped(real: Any) -> Any:
    """``trainer.sliced.pieces`` that leaves the first tensor's first piece out."""

    def pieces(*args: Any, **kw: Any) -> Any:
        for i, group in enumerate(real(*args, **kw)):
            yield group[1:] if i == 0 else group

    return pieces


PHASES = ["worker-before", "worker-during", "trainer-during", "outside-wants", "missing-piece"]


@pytest.mark.parametrize("phase", PHASES)
def test_a_sliced_round_that_fails_leaves_every_worker_on_the_previous_round(
    phase: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker whose link dies before its first piece or mid-round, the trainer's link
    killed mid-round, a piece outside a worker's wants, a piece left out: the round raises
    naming what happened, every worker keeps the previous round's weights exactly, and
    after the engine's re-init the next round is sliced and lands whole."""
    from weightwire.trainer import sliced
    from weightwire.trainer import sole_round as round_module

    client = TPClient(TP2)
    tensors: dict[str, Any] = {}
    engine = torch_engine(client, tensors)
    try:
        _, before = committed_round(engine, client, tensors)
        match = {
            "worker-before": "lost|closed|aborted",
            "worker-during": "lost|closed|aborted",
            "trainer-during": "lost|closed|aborted",
            "outside-wants": r"outside what this worker wants",
            "missing-piece": r"brought \d+ of the \d+ elements of",
        }[phase]
        if phase == "worker-before":
            client.before_update = lambda n: client.engines[1].abort_transfer()
        elif phase == "worker-during":
            cut_link_at(engine, worker=1, read=10)
        elif phase == "trainer-during":
            real, reads = engine.read_box, [0]

            def killed(tensor: Any, box: Any) -> Any:
                reads[0] += 1
                if reads[0] == 10:
                    engine.session.link.abort()
                return real(tensor, box)

            engine.read_box = killed
        else:
            real_pieces = sliced.pieces
            fault = shifted(real_pieces, 0) if phase == "outside-wants" else dropped(real_pieces)
            monkeypatch.setattr(round_module, "pieces", fault)
        load(tensors, 2)
        fails_keeping(engine, client, before, match)
        monkeypatch.undo()
        client.before_update = None
        engine = lands_after_reinit(engine, client, tensors)
    finally:
        engine.shutdown()
        client.close()


def test_a_worker_link_lost_after_its_pieces_commits_the_round_and_stops_the_next() -> None:
    """Worker 1's link dies once every piece landed (before the finish): each worker holds
    its whole slice, so the round commits on both; the next round is refused before any
    call (the server closed this trainer's link), and after a re-init it lands whole."""
    client = TPClient(TP2)
    tensors: dict[str, Any] = {}
    engine = torch_engine(client, tensors)
    try:
        full = load(tensors, 1)
        client.before_finish = lambda: client.engines[1].abort_transfer()
        engine.send_weights()
        assert_loaded(client, full)
        client.before_finish = None
        updates = client.updates
        load(tensors, 2)
        engine = again(engine, client, tensors)
        assert client.updates == updates  # the refused round sent nothing
        lands_sliced(engine, client, tensors, 3)
    finally:
        engine.shutdown()
        client.close()


def fail_commit(client: TPClient, worker: int) -> None:
    """Worker ``worker``'s next commit fails before it writes a tensor (an out-of-memory at
    its load), while the others commit theirs."""

    def refuse() -> None:
        raise RuntimeError(f"out of memory loading the round on worker {worker}")

    def arm() -> None:
        client.engines[worker]._core._round.commit = refuse
        client.before_finish = None

    client.before_finish = arm


@pytest.mark.parametrize("sliced", ["auto", "off"])
@pytest.mark.parametrize("delta", [False, True], ids=["dense", "delta"])
def test_a_commit_failing_on_one_rank_keeps_the_model_refused_until_a_whole_round(
    delta: bool, sliced: str
) -> None:
    """A staged round (no pause: ``auto`` within the budget) whose commit fails on worker 1
    only: worker 0 serves the new slice beside worker 1's old one, so worker 1 says the
    model is not whole (naming its ranks), the trainer holds the round guard and its release
    is refused (requests refused, saying why); the next round commits whole on both and
    lifts the guard. Sliced or broadcast alike: a broadcast session's worker knows it is
    one of the model's ranks from vLLM's parallel world (``model_ranks``, set here as the
    plugin's engine sets it). Was: each worker said whole, no guard: a half-new model
    served."""
    client = GuardClient(TP2)
    if sliced == "off":
        for engine in client.engines:
            engine._core.model_ranks = 2  # vLLM's parallel_config.world_size at TP 2
    tensors: dict[str, Any] = {}
    delta_mode = "auto" if delta else "off"
    with opened(client, tensors, pause_mode="auto", delta=delta_mode, sliced=sliced) as engine:
        full = load(tensors, 1)
        engine.send_weights()
        assert client.calls == []  # a staged round under auto: no pause, no guard
        fail_commit(client, 1)
        new = load(tensors, 2)
        with pytest.raises(WeightwireError, match="other ranks may have committed"):
            engine.send_weights()
        half = params(client)
        assert all(torch.equal(half[0][n], t) for n, t in expected(TP2, new, 0).items())
        assert all(torch.equal(half[1][n], t) for n, t in expected(TP2, full, 1).items())
        whole = state(client)
        assert whole[0]["whole"] is True and whole[1]["whole"] is False
        assert "other ranks may have committed" in whole[1]["reason"]
        assert client.held and client.calls == ["hold", "release refused"]
        full = load(tensors, 3)
        engine.send_weights()
        assert client.last_update.get("sliced") is (True if sliced == "auto" else None)
        assert_loaded(client, full)
        assert [s["whole"] for s in state(client)] == [True, True]
        assert not client.held and client.calls[2:] == ["hold", "release"]


def test_a_commit_failing_on_a_worker_of_its_own_model_lifts_the_guard_at_once() -> None:
    """Workers that each serve a whole model (data-parallel replicas: a broadcast session,
    no parallel world told): a commit failing on worker 1 leaves each one whole (worker 0 the
    new round, worker 1 the old), so the guard the trainer holds after the failed finish is
    released at once and nothing stays refused; a ``TPClient`` without a guard gets no log
    over such workers."""
    client = GuardClient(TP2)
    tensors: dict[str, Any] = {}
    with opened(client, tensors, pause_mode="auto", sliced="off") as engine:
        load(tensors, 1)
        engine.send_weights()
        fail_commit(client, 1)
        load(tensors, 2)
        with pytest.raises(RuntimeError, match="out of memory"):
            engine.send_weights()
        assert [s["whole"] for s in state(client)] == [True, True]
        assert not client.held and client.calls == ["hold", "release"]
        assert not engine.session.guard_left_held


def test_without_a_guard_a_commit_failing_on_one_rank_is_logged(caplog) -> None:
    """No round guard on the servers: a sliced round's commit failing on one rank raises
    naming it, and an error log says the model's ranks hold different rounds and how to
    have them refused (the guard's middleware)."""
    client = TPClient(TP2)
    tensors: dict[str, Any] = {}
    with opened(client, tensors, pause_mode="auto") as engine:
        load(tensors, 1)
        engine.send_weights()
        fail_commit(client, 1)
        load(tensors, 2)
        with pytest.raises(WeightwireError, match="other ranks may have committed"):
            engine.send_weights()
        assert "no round guard to refuse requests meanwhile (start vLLM with --middleware" in (
            caplog.text
        )
        assert client.engines[1].incomplete_round is not None
        full = load(tensors, 3)
        engine.send_weights()
        assert_loaded(client, full)
        assert client.engines[1].incomplete_round is None


# ------------------------------------------------------------------ 6. wants that do not fit

ATTN_Q = "model.layers.0.self_attn.q_proj.weight"


def lacks_layer(full: dict[str, np.ndarray]) -> None:
    for name in [n for n in full if n.startswith("model.layers.1.")]:
        del full[name]


def lacks_one(full: dict[str, np.ndarray]) -> None:
    del full["model.layers.0.mlp.up_proj.weight"]


def smaller(full: dict[str, np.ndarray]) -> None:
    full[ATTN_Q] = np.zeros((4, 8), np.float32)  # the served model's q_proj is [8, 8]


def larger(full: dict[str, np.ndarray]) -> None:
    full[ATTN_Q] = np.zeros((16, 8), np.float32)


def unknown(full: dict[str, np.ndarray]) -> None:
    full["model.layers.0.extra.weight"] = np.zeros((4, 8), np.float32)


class ToldClient(TPClient):
    """Workers that also tell the trainer their served model at init (what the plugin's
    ``workers_served_model`` answers)."""

    def workers_served_model(self) -> Any:
        from weightwire.shared.served import ServedModel

        return ServedModel.from_dict(self.engines[0].served_model())


@pytest.mark.parametrize(
    ("change", "told", "error", "match"),
    [
        (
            lacks_layer,
            False,
            "ServedModelMismatch",
            r"worker 0 reads 13 checkpoint tensor\(s\) "
            r"the round lacks \[model\.layers\.1\..*partial=True",
        ),
        (
            lacks_one,
            False,
            "ServedModelMismatch",
            r"worker 0 reads 1 checkpoint tensor\(s\) "
            r"the round lacks \[model\.layers\.0\.mlp\.up_proj\.weight\]",
        ),
        (
            smaller,
            False,
            "SliceError",
            r"worker 1's wants: .*q_proj\.weight.*box \[4:8, 0:8\] .*"
            r"outside the tensor's shape \[4, 8\]: worker 1 serves a checkpoint whose tensors",
        ),
        (
            larger,
            False,
            "ValueError",
            r"q_proj\.weight' has shape \[16, 8\], the model's is "
            r"\[8, 8\]; the round was refused before any byte",
        ),
        (unknown, False, "ValueError", r"'model\.layers\.0\.extra\.weight' is not a tensor of"),
        (lacks_layer, True, "ServedModelMismatch", r"13 tensor\(s\) .* missing from the round"),
        (larger, True, "ServedModelMismatch", r"q_proj\.weight \[16, 8\] \(served: \[8, 8\]\)"),
        (unknown, True, "ServedModelMismatch", r"extra\.weight\] unknown to the served model"),
    ],
    ids=[
        "lacks-layer",
        "lacks-one",
        "smaller",
        "larger",
        "unknown",
        "told-lacks-layer",
        "told-larger",
        "told-unknown",
    ],
)
def test_a_source_that_does_not_fit_the_workers_wants_is_refused_before_any_byte(
    change: Any, told: bool, error: str, match: str
) -> None:
    """A source whose tensors differ from the workers' served checkpoint (a layer or a tensor
    missing, a smaller or larger shape, a tensor the workers lack): refused, naming the
    worker or the served model, the tensor and the fix, and no worker's weights change. The
    trainer refuses before any call where it can tell: a tensor a worker reads that the round
    lacks (from the worker's hello, whether or not the servers told their served model), a
    box outside the trainer's tensor, and, told the served model, every mismatch; else each
    worker refuses the update before its first byte (``ValueError`` here: an HTTP server's
    refusal is a ``WeightSyncError``)."""
    client = (ToldClient if told else TPClient)(TP2)
    before = params(client)
    full = full_tensors(TP2, 1)
    change(full)
    with opened(client, as_source("torch", full)) as engine:
        with pytest.raises(Exception, match=match) as got:
            engine.send_weights()
        assert type(got.value).__name__ == error
        if error != "ValueError":
            assert isinstance(got.value, WeightwireError)
            assert client.updates == 0  # nothing sent: not even the update POST
        assert_kept(client, before)


def test_partial_rounds_may_leave_out_what_the_workers_read() -> None:
    """``partial=True``: a round that leaves a layer out on purpose is sliced and lands; the
    layer it left out keeps its previous weights on every worker."""
    client = TPClient(TP2)
    tensors: dict[str, Any] = {}
    with opened(client, tensors, partial=True) as engine:
        load(tensors, 1)
        engine.send_weights()
        frozen = params(client)
        full = load(tensors, 2)
        lacks_layer(tensors)
        engine.send_weights()
        assert client.last_update["sliced"] is True
        layer1 = ("experts.w13_weight", "experts.w2_weight", "router.weight")
        for rank, was in enumerate(frozen):
            want, now = expected(TP2, full, rank), client.params(rank)
            for name, tensor in now.items():
                assert torch.equal(tensor, was[name] if name in layer1 else want[name]), name


# ------------------------------------------------------------------ 5. adapters


class AdapterHost:
    """A worker's in-memory adapter host (what ``torch_side.worker.vllm_lora`` is in vLLM):
    the adapter each commit swapped in, whole."""

    def __init__(self) -> None:
        self.swapped: list[dict[str, torch.Tensor]] = []

    def check(self, spec: Any) -> None:
        pass

    def swap(self, spec: Any, tensors: dict[str, torch.Tensor]) -> None:
        self.swapped.append({n: t.clone() for n, t in tensors.items()})


def test_adapter_rounds_on_a_sliced_session_go_whole_and_base_rounds_stay_sliced() -> None:
    """A LoRA adapter sent in memory to TP workers that slice their base weights: its round
    is a broadcast (the workers told no wants of the adapter's tensors; vLLM's LoRA layers
    take the whole adapter and cut their own shard), every worker swaps in the whole adapter
    at the commit and its base weights stay; the next base-weight round is sliced again."""
    from weightwire.shared.lora import wire_name
    from weightwire.torch_side.worker.engines import WeightwireTCPEngine

    client = TPClient(TP2)
    hosts = [AdapterHost() for _ in client.models]
    client.engines = [
        WeightwireTCPEngine(
            model=m,
            device="cpu",
            worker_rank=r,
            spec=lambda: spec_of(TP2),
            adapters=lambda h=hosts[r]: h,  # type: ignore[misc]
        )
        for r, m in enumerate(client.models)
    ]
    tensors: dict[str, Any] = {}
    base = torch_engine(client, tensors)
    try:
        load(tensors, 1)
        base.send_weights()
        assert client.last_update["sliced"] is True
        base.shutdown()
        before = params(client)
        q = "model.layers.0.self_attn.q_proj"
        gen = torch.Generator().manual_seed(0)
        adapter = {
            wire_name(q, "A", "pol"): torch.randn(2, 8, generator=gen),
            wire_name(q, "B", "pol"): torch.randn(8, 2, generator=gen),
        }
        lora = torch_engine(client, adapter)
        try:
            lora.send_weights()
            assert "sliced" not in client.last_update
        finally:
            lora.shutdown()
        for host in hosts:
            ((swapped),) = host.swapped
            assert sorted(swapped) == [f"base_model.model.{q}.lora_{x}.weight" for x in ("A", "B")]
            for x in ("A", "B"):
                want = adapter[wire_name(q, x, "pol")]
                assert torch.equal(swapped[f"base_model.model.{q}.lora_{x}.weight"], want)
        assert_kept(client, before)
        base = torch_engine(client, tensors)
        lands_sliced(base, client, tensors, 2)
    finally:
        base.shutdown()
        client.close()


@pytest.mark.parametrize("budget", [1 << 30, 0], ids=["staged", "in-place"])
def test_a_second_trainer_is_refused_while_a_sliced_round_is_open(budget: int) -> None:
    """Another trainer's init reaching a worker while a live sliced round is open there
    (staged or in place) is refused naming the session in progress; the open round is
    untouched and commits whole."""
    client = TPClient(TP2)
    tensors: dict[str, Any] = {}
    engine = torch_engine(client, tensors, stage_budget_bytes=budget)
    refused: list[str] = []

    def second_trainer() -> None:
        with pytest.raises(RuntimeError, match="refused: a weight update of session") as got:
            client.engines[0].init_transfer_engine(dict(client.init_info))
        refused.append(str(got.value))

    client.before_finish = second_trainer
    try:
        full = load(tensors, 1)
        engine.send_weights()
        assert refused and client.last_update["sliced"] is True
        assert_loaded(client, full)
    finally:
        engine.shutdown()
        client.close()


def test_an_overlapped_sliced_round_refused_before_any_call_leaves_the_session_usable() -> None:
    """An overlapped round whose source lacks a tensor the workers read is refused on its own
    handle before any call (``ServedModelMismatch``); the engine is not broken: the next
    overlapped round, whole again, is sliced and lands without a re-init."""
    from weightwire.shared.served import ServedModelMismatch

    client = TPClient(TP2)
    tensors: dict[str, Any] = {}
    with opened(client, tensors) as engine:
        load(tensors, 1)
        lacks_one(tensors)
        with pytest.raises(ServedModelMismatch, match=r"up_proj\.weight\]"):
            engine.send_weights(wait=False).result(timeout=60)
        assert client.updates == 0
        full = load(tensors, 2)
        engine.send_weights(wait=False).result(timeout=60)
        assert client.last_update["sliced"] is True
        assert_loaded(client, full)


@pytest.mark.parametrize("snapshot", ["copy", "cow"])
def test_an_optimizer_step_during_an_overlapped_sliced_round_does_not_leak_in(
    snapshot: str,
) -> None:
    """A torch optimizer's step right after ``send_weights(wait=False)`` on a sliced session:
    the round sends the weights of the call (``copy``: its buffers; ``cow``: the step waits
    for, or copies ahead of, the pieces the round still reads), never a mix of two steps."""
    client = TPClient(TP2)
    tensors: dict[str, Any] = {}
    with opened(client, tensors, snapshot=snapshot) as engine:
        full = full_tensors(TP2, 1)
        weights = {n: torch.nn.Parameter(torch.from_numpy(a.copy())) for n, a in full.items()}
        tensors.update(weights)
        step = torch.optim.SGD(list(weights.values()), lr=1.0)
        for w in weights.values():
            w.grad = torch.ones_like(w)
        handle = engine.send_weights(wait=False)
        step.step()  # every weight moves by -1
        handle.result(timeout=60)
        assert client.last_update["sliced"] is True
        assert_loaded(client, full)
        moved = {n: a - 1 for n, a in full.items()}
        assert all(torch.equal(weights[n].detach(), torch.from_numpy(a)) for n, a in moved.items())
        engine.send_weights(wait=False).result(timeout=60)
        assert_loaded(client, moved)


class FinishingTP(TPClient):
    """``TPClient`` as one server whose update also commits (``routes.UPDATE_FINISHES``, the
    reference server's offer): ``update_and_finish`` is the update, then (once it held) the
    finish, in one call."""

    base_url = "http://tp:1"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.in_update: list[tuple[str | None, bool, bool]] = []

    def updates_with_finish(self) -> bool:
        return True

    def update_and_finish(
        self, update_info: Any, weight_version: str | None, *, reset_caches: bool, resume: bool
    ) -> list[dict[str, Any]]:
        self.in_update.append((weight_version, reset_caches, resume))
        self.update_weights(update_info)
        self.finish_weight_update(weight_version)
        return [{"caches_reset": reset_caches, **({"resumed": True} if resume else {})}]


@pytest.mark.parametrize("budget", [1 << 30, 0], ids=["staged", "in_place"])
def test_sliced_rounds_commit_in_their_update_and_a_failed_one_commits_nothing(
    budget: int,
) -> None:
    """One server whose update commits: each sliced round (TP 2) is one update that finishes
    (the finish in the same call), lands whole on both workers; a round whose link is cut
    mid-transfer fails on its update, so its finish never runs (staged: both keep the
    previous round); after a re-init the next round lands whole."""
    client = FinishingTP(TP2)
    tensors: dict[str, Any] = {}
    engine = torch_engine(client, tensors, stage_budget_bytes=budget, pause_mode="auto")
    try:
        lands_sliced(engine, client, tensors, 1)
        full = lands_sliced(engine, client, tensors, 2)
        assert [v for v, _, _ in client.in_update] == ["1", "2"]
        finishes = []
        client.before_finish = lambda: finishes.append(True)
        before = params(client)
        cut_link_at(engine, worker=1, read=10)
        load(tensors, 3)
        with pytest.raises(WeightwireError, match="lost|closed|aborted"):
            engine.send_weights()
        assert finishes == [] and len(client.in_update) == 3  # the update failed: no commit
        if budget:  # in place, a worker that took a piece before the cut holds part of it
            assert_kept(client, before)
            assert_loaded(client, full)
        client.before_finish = None
        engine = lands_after_reinit(engine, client, tensors)
    finally:
        engine.shutdown()
        client.close()
