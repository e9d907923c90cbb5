"""Several trainer processes' sliced rounds, their agreement over the trainer group
(``trainer.multi_sliced``), with threads standing in for the processes (``DictGroup``): the
union of what each says it holds, the same plan on every one or an error naming the odd one
on every one. The rounds themselves: ``test_sliced_tcp`` (2 JAX processes, 2 torch ranks)."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from weightwire.shared.meta import ParamMeta
from weightwire.shared.slices import Box, Wants
from weightwire.shared.timeouts import Timeouts
from weightwire.trainer.group import DictGroup
from weightwire.trainer.multi_base import Ranks
from weightwire.trainer.multi_sliced import SeveralSlicing
from weightwire.trainer.slice_plan import Held, Holdings, SlicePlanError, build_plan

METAS = [ParamMeta("w", "float32", (4, 2)), ParamMeta("n", "float32", (2,))]
SHAPES = {"w": (4, 2), "n": (2,)}
WANTS = [
    Wants({"w": (Box.of((0, 4), (0, 1)),), "n": (Box.whole((2,)),)}),
    Wants({"w": (Box.of((0, 4), (1, 2)),), "n": (Box.whole((2,)),)}),
]


def on_both(body: Callable[[SeveralSlicing, int], Any]) -> list[Any]:
    """``body`` on two ranks at once; each one's result or exception."""
    groups = DictGroup.make(2)
    timeouts = Timeouts(http_s=5, connect_s=5, warmup_s=5, transfer_s=5)

    def one(rank: int) -> Any:
        session: Any = SimpleNamespace(info=SimpleNamespace(rank=rank, timeouts=timeouts))
        try:
            return body(SeveralSlicing(Ranks(session, groups[rank])), rank)
        except Exception as exc:
            return exc

    with cf.ThreadPoolExecutor(2) as pool:
        return list(pool.map(one, range(2)))


def test_each_process_tells_what_it_holds_itself_and_all_get_the_union() -> None:
    # a plain tensor is known whole only to its holder; a sharded one's boxes to every process
    def mine(rank: int) -> Holdings:
        held = [Held("w", r, Box.of((2 * r, 2 * r + 2), (0, 2))) for r in (0, 1)]
        return Holdings.of(SHAPES, [*held, Held("n", rank, Box.whole((2,)))])

    merged = on_both(lambda x, rank: x.merge(mine(rank)))
    assert merged[0] == merged[1]
    assert {h.rank for h in merged[0].held["n"]} == {0, 1}
    assert len(merged[0].held["w"]) == 2
    plan = build_plan(METAS, merged[0], WANTS)
    assert sorted(plan.rank_bytes) == [0, 1]  # both send: w's rows, and n from one of them


def test_processes_that_build_different_plans_are_refused_naming_the_odd_one() -> None:
    whole = [Held("w", 0, Box.whole((4, 2))), Held("n", 0, Box.whole((2,)))]
    split = [
        Held("w", 0, Box.of((0, 2), (0, 2))),
        Held("w", 1, Box.of((2, 4), (0, 2))),
        Held("n", 1, Box.whole((2,))),
    ]
    plans = [build_plan(METAS, Holdings.of(SHAPES, h), WANTS) for h in (whole, split)]
    errors = on_both(lambda x, rank: x.agree(plans[rank], None))
    for exc in errors:
        assert isinstance(exc, SlicePlanError)
        assert "trainer ranks [1] built another slice plan than rank 0" in str(exc)
        assert "sliced='off'" in str(exc)


def test_a_process_that_could_not_plan_is_named_on_every_process() -> None:
    held = [Held("w", 0, Box.whole((4, 2))), Held("n", 0, Box.whole((2,)))]
    plan = build_plan(METAS, Holdings.of(SHAPES, held), WANTS)
    errors = on_both(
        lambda x, rank: x.agree(plan, None if rank == 0 else "SlicePlanError: no shard holds w")
    )
    for exc in errors:
        assert isinstance(exc, SlicePlanError)
        assert str(exc) == (
            "trainer rank 1 could not build the slice plan: SlicePlanError: no shard holds w"
        )


def test_rank_zero_refusing_its_go_releases_the_others_with_its_reason() -> None:
    from weightwire.trainer.multi_base import RoundFailed

    def body(x: SeveralSlicing, rank: int) -> Any:
        if rank == 0:
            x.in_flight = True  # a plan was agreed, then the start failed
            x.release()
            x.ranks.exchange.post("verdict", {"error": "RuntimeError: start refused"})
            return None
        return x._await_go()

    zero, one = on_both(body)
    assert zero is None
    assert isinstance(one, RoundFailed)
    assert str(one) == (
        "trainer rank 0 ended the sliced round before its first byte: RuntimeError: start refused"
    )


@pytest.mark.parametrize("posted", [None, [1, 2], "x"])
def test_hellos_in_an_unknown_form_are_refused(posted: Any) -> None:
    from weightwire.trainer.multi_sliced import decode_hellos

    with pytest.raises(SlicePlanError, match="wants in an unknown form"):
        decode_hellos(posted)


def test_a_round_refused_everywhere_before_any_byte_keeps_what_rank_zero_keeps() -> None:
    """A follower keeps its engine (its star unaborted) exactly where the whole group refused
    the round before any byte and rank 0's verdict says it kept its own: its "go" refused, or
    the plan agreement refused; its own failure (its star may hold part) never keeps it."""
    from weightwire.trainer.multi_base import RoundFailed

    held = [Held("w", 0, Box.whole((4, 2))), Held("n", 0, Box.whole((2,)))]
    plan = build_plan(METAS, Holdings.of(SHAPES, held), WANTS)

    def body(x: SeveralSlicing, rank: int) -> Any:
        kept = []
        for verdict in ({"kept": True}, {"kept": False}):
            x.ranks.exchange.step()
            x.new_round()
            if rank == 0:  # the start refused before the "go"
                x.in_flight = True
                x.release()
                x.ranks.exchange.post("verdict", {"error": "WeightSyncError: asleep", **verdict})
                assert not x.opened
                continue
            try:
                x._await_go()
            except RoundFailed as exc:
                kept.append(x.kept_before_any_byte(exc))
        x.ranks.exchange.step()
        try:
            x.agree(plan, None if rank == 0 else "SlicePlanError: no shard holds w")
        except SlicePlanError as exc:
            if rank == 0:
                x.ranks.exchange.post("verdict", {"error": str(exc), "kept": True})
                return None
            kept.append(x.kept_before_any_byte(exc))
        kept.append(x.kept_before_any_byte(RuntimeError("rank 1's own source failed")))
        return kept

    zero, one = on_both(body)
    assert zero is None
    assert one == [True, False, True, False]
