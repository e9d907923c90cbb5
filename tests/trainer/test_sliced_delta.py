"""Delta rounds on sliced sessions over ``weightwire_tcp``, end to end on CPU: a trainer engine
with ``delta="auto"`` and in-process TCP workers hosting ``SlicedTP`` ranks (the fixtures of
``test_sliced_tcp``). Each worker receives only the patch elements whose checkpoint
coordinates fall in the boxes it wants (its share, told in the update info), applies them
through its landing map, and ends bit-identical to ``load_weights`` of the full new tensors;
a wrong base, a short share, an element outside its wants or a link lost mid-round leave
every worker on the previous weights."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch

from tests.trainer._sliced_session import (
    TP2,
    TP4,
    as_source,
    assert_loaded,
    assert_shares,
    changed,
    committed_round,
    fails_keeping,
    full_tensors,
    opened,
    prepacked,
    put,
    run_script,
)
from tests.trainer._sliced_workers import Config, TPClient
from weightwire.shared.errors import DeltaBaseMismatch
from weightwire.shared.slices import Box, Wants, volume

PATCHED = "model.layers.0.self_attn.o_proj.weight"


def told(client: TPClient, rank: int) -> Wants:
    """The wants worker ``rank`` told its trainer at the join."""
    wants = client.engines[rank]._core._told
    assert wants is not None
    return wants


def share_bytes(
    client: TPClient, rank: int, before: dict[str, np.ndarray], after: dict[str, np.ndarray]
) -> int:
    """What the last (delta) update should bring worker ``rank``, counted here from the
    weights and the worker's own wants: every changed element of a patched tensor inside its
    boxes (4 index bytes + 4 value bytes), every wanted element of a tensor sent dense."""
    update = client.last_update
    patched = {p[0] for p in update["patches"]}
    regions = told(client, rank).regions
    total = 0
    for name in patched:
        index = np.flatnonzero(before[name].reshape(-1) != after[name].reshape(-1))
        coords = np.unravel_index(index, after[name].shape)
        boxes = regions.get(name, (Box.whole(after[name].shape),))
        inside = np.zeros(len(index), dtype=bool)
        for box in boxes:
            hit = np.ones(len(index), dtype=bool)
            for c, (lo, hi) in zip(coords, box.ranges, strict=True):
                hit &= (c >= lo) & (c < hi)
            inside |= hit
        total += 8 * int(inside.sum())
    for name in update["names"]:
        if "@" not in name:
            total += 4 * volume(regions.get(name, (Box.whole(after[name].shape),)))
    return total


def broadcast_bytes(update: dict[str, Any]) -> int:
    """What a broadcast delta round of this update would send every worker."""
    return sum(4 * int(np.prod(s)) for s in update["shapes"])


@pytest.mark.parametrize(
    ("config", "framework"),
    [(TP2, "torch"), (TP2, "jax"), (TP4, "torch")],
    ids=["tp2-tied-kv1-torch", "tp2-tied-kv1-jax", "tp4-kv2-torch"],
)
def test_sliced_delta_rounds_send_each_worker_its_share(config: Config, framework: str) -> None:
    """A dense round, then 2 deltas at a 2 % change rate: each worker bit-identical to
    ``load_weights`` of the full new tensors after every round; of each delta round it
    received exactly the patch elements inside its wants (counted by the worker, what
    ``bytes_received`` reports), strictly less than the broadcast delta round's bytes."""
    client = TPClient(config)
    tensors: dict[str, Any] = {}
    with opened(client, tensors, framework, delta="auto") as engine:
        full = full_tensors(config, 1)
        put(tensors, full, framework)
        engine.send_weights()
        assert client.last_update["sliced"] is True and "patches" not in client.last_update
        assert_loaded(client, full)
        for step in (2, 3):
            before, full = full, changed(full, step)
            put(tensors, full, framework)
            metrics = engine.send_weights()
            update = client.last_update
            assert update["sliced"] is True and update["patches"]
            assert len(update["shares"]) == config[0]
            assert_loaded(client, full)
            broadcast = broadcast_bytes(update)
            for rank in range(config[0]):
                assert client.received[rank] == share_bytes(client, rank, before, full)
                assert 0 < client.received[rank] < broadcast
                stats = client.engines[rank].round_stats()
                assert stats is not None and stats["bytes_received"] == client.received[rank]
            assert metrics.nbytes == sum(client.received)
        slicing = engine.session.slicing
        assert (slicing.plans.builds, slicing.delta_plans.builds) == (1, 1)  # each planned once


def test_a_delta_round_on_a_wrong_base_is_refused_before_any_byte() -> None:
    """Every worker forgot the base (its weights changed behind the session): each refuses
    the sliced delta round at its update info (``DeltaBaseMismatch``), before any byte, with
    the previous weights kept; the trainer then sends the same round dense and sliced."""
    client = TPClient(TP2)
    tensors: dict[str, Any] = {}
    with opened(client, tensors, delta="auto") as engine:
        refused: list[tuple[int, int, bool]] = []
        full, before = committed_round(engine, client, tensors)
        for e in client.engines:
            e._core.weights.weights_changed("the test changed the weights")
            real = e.update_weights

            def checked(update: dict[str, Any], e: Any = e, real: Any = real) -> None:
                try:
                    real(update)
                except DeltaBaseMismatch:
                    rank = e._core.worker_rank
                    stats = e.round_stats()
                    same = all(
                        torch.equal(t, client.params(rank)[n]) for n, t in before[rank].items()
                    )
                    refused.append((rank, stats["bytes_received"] if stats else 0, same))
                    raise

            e.update_weights = checked
        full = changed(full, 2)
        put(tensors, full, "torch")
        engine.send_weights()
        assert sorted(refused) == [(0, 0, True), (1, 0, True)]
        assert "patches" not in client.last_update and client.last_update["sliced"] is True
        assert_loaded(client, full)


def test_a_sliced_delta_round_over_the_stage_budget_lands_in_place_whole() -> None:
    """``stage_budget_bytes=0``: the delta round's dense tensor (o_proj, changed whole) is
    written piece by piece as it lands, its patches at the commit; every worker ends
    bit-identical to ``load_weights`` of the full new tensors. The delta rounds are
    overlapped (``wait=False``): sliced too."""
    client = TPClient(TP4)
    tensors: dict[str, Any] = {}
    with opened(client, tensors, delta="auto", stage_budget_bytes=0, pause_mode="keep") as engine:
        seen: list[str | None] = []
        client.before_finish = lambda: seen.extend(e.round_strategy for e in client.engines)
        full = full_tensors(TP4, 1)
        put(tensors, full, "torch")
        engine.send_weights()
        for step in (2, 3):
            full = changed(full, step)
            full[PATCHED] = full[PATCHED] + 1.0  # every element: sent dense
            put(tensors, full, "torch")
            engine.send_weights(wait=False).result(timeout=60)
            assert client.last_update["patches"] and PATCHED in client.last_update["names"]
            assert_loaded(client, full)
        assert seen == ["sliced_in_place"] * 12


def test_a_link_lost_mid_delta_round_leaves_the_previous_weights() -> None:
    """Worker 1's link drops once worker 0 got its whole share: the round fails on the
    trainer, nothing commits, both workers keep the previous round's weights exactly."""
    client = TPClient(TP2)
    tensors: dict[str, Any] = {}
    with opened(client, tensors, delta="auto") as engine:
        full, before = committed_round(engine, client, tensors)
        comm = engine.session.link
        send_frame = comm.send_frame

        def cut(rank: int, *args: Any, **kw: Any) -> Any:
            if rank == 2:  # worker 1's frame: its link drops first
                comm._links[1].sock.shutdown(2)
            return send_frame(rank, *args, **kw)

        comm.send_frame = cut
        put(tensors, changed(full, 2), "torch")
        fails_keeping(engine, client, before)


def test_a_worker_refuses_patch_elements_outside_its_wants(monkeypatch) -> None:
    """A trainer that filtered by other wants (here: every worker given every element, the
    shares told to match): the worker refuses the update before anything of it applies."""
    from weightwire.trainer import sole_round as round_

    client = TPClient(TP2)
    tensors: dict[str, Any] = {}
    with opened(client, tensors, delta="auto") as engine:
        full, before = committed_round(engine, client, tensors)
        real = round_.share_patches

        def everything(patches: Any, tensors: Any, wants: Any, host_bytes: Any) -> Any:
            whole = {p.name: (Box.whole(p.shape),) for p in patches}
            return real(patches, tensors, [Wants(whole) for _ in wants], host_bytes)

        monkeypatch.setattr(round_, "share_patches", everything)
        put(tensors, changed(full, 2), "torch")
        fails_keeping(engine, client, before, r"outside what this worker wants")


def test_a_worker_refuses_a_short_share(monkeypatch) -> None:
    """One piece of a share left out (the update info still tells the whole share): the
    worker refuses once its last piece landed, nothing applies, the weights stay."""
    from weightwire.trainer.sliced_delta import PatchShares

    client = TPClient(TP2)
    tensors: dict[str, Any] = {}
    with opened(client, tensors, delta="auto") as engine:
        full, before = committed_round(engine, client, tensors)
        real = PatchShares.pieces

        def short(self: PatchShares, *args: Any, **kw: Any) -> Any:
            out = real(self, *args, **kw)
            first = next(i for i, group in sorted(out.items()) if group)
            out[first] = out[first][1:]
            return out

        monkeypatch.setattr(PatchShares, "pieces", short)
        put(tensors, changed(full, 2), "torch")
        fails_keeping(engine, client, before, r"brought \d+ of the \d+ elements of")


def test_workers_that_load_through_load_weights_keep_dense_sliced_rounds(caplog) -> None:
    """A worker whose parameters are processed after loading (a CPU vLLM's prepack) loads
    its slices through ``load_weights`` and says at the join that it applies no patches:
    the session's ``delta="auto"`` rounds go dense and sliced (no worker gets an element
    outside its wants), said once in the log; the weights are right."""

    client = TPClient(TP2, model=prepacked)
    tensors: dict[str, Any] = {}
    with opened(client, tensors, delta="auto") as engine:
        assert client.init_info["delta_rounds"] is True
        hellos = [json.loads(h) for h in engine.session.slicing.hellos]
        assert [h["patches"] for h in hellos] == [False, False]
        full = full_tensors(TP2, 1)
        for step in (1, 2, 3):
            if step > 1:
                full = changed(full, step)
            put(tensors, full, "torch")
            with caplog.at_level("INFO", logger="weightwire.trainer.sliced"):
                engine.send_weights()
            assert client.last_update["sliced"] is True and "patches" not in client.last_update
            assert_loaded(client, full)
            dense = sum(a.nbytes for a in full.values())
            assert_shares(client.received, TP2, dense)
        said = [
            r.getMessage() for r in caplog.records if "sends dense sliced rounds" in r.getMessage()
        ]
        assert len(said) == 1 and "worker 0 did not say it applies sliced patches" in said[0]


def test_workers_with_a_landing_map_say_they_apply_sliced_patches() -> None:
    client = TPClient(TP2)
    with opened(client, as_source("torch", full_tensors(TP2, 1))) as engine:
        hellos = [json.loads(h) for h in engine.session.slicing.hellos]
        assert [h["patches"] for h in hellos] == [True, True]
        assert engine.session.slicing.patch_takers == [True, True]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dict", "pytree"])
def test_jax_delta_rounds_from_an_fsdp_tp_mesh(kind: str) -> None:
    """A JAX trainer whose arrays are sharded over 8 forced host devices (FSDP 4 x TP 2), in
    a subprocess (XLA_FLAGS precede jax's import): a dense round then 2 sliced delta rounds,
    every worker bit-identical to ``load_weights`` of the full tensors (checked there), each
    delta round's share strictly less than the broadcast patches. The patches are extracted
    shard by shard: every round runs with the gather entry points refusing and no whole copy
    of a sharded array alive at any extraction step (checked there); the base is sharded as
    the arrays are, its bytes the addressable shards'. ``pytree``: a ``PytreeSource`` over the
    arrays (one of them transposed back on its shards) is compared where it is held too."""
    rounds = run_script("_sliced_delta_jax_mesh.py", kind)["rounds"]
    assert [r["patches"] for r in rounds] == [False, True, True, True]
    for r in rounds[1:]:
        assert sum(r["received"]) == r["sent"]
        assert all(0 < got < r["broadcast"] for got in r["received"])
    # the base: a copy of the addressable shards (replicas each), never a gathered copy
    assert all(r["base"] == r["shards"] > r["dense"] for r in rounds)


def test_share_patches_keeps_each_workers_elements_in_order() -> None:
    """The vectorised filter against a per-element reference, over random patches and wants
    (several boxes, a tensor wanted whole, one wanted not at all): each worker gets exactly
    the elements inside its boxes, indices increasing, values with them."""
    from weightwire.shared.delta import Patch
    from weightwire.trainer.sliced_delta import share_patches

    rng = np.random.default_rng(7)
    shape = (6, 10)
    index = np.sort(rng.choice(60, 25, replace=False)).astype(np.int32)
    values = rng.standard_normal(25).astype(np.float32)
    patch = Patch("w", "float32", shape, 25)
    wants = [
        Wants({"w": (Box.of((0, 3), (0, 10)), Box.of((3, 6), (4, 7)))}),
        Wants({"w": (Box.whole(shape),)}),
        Wants({"w": ()}),
    ]
    tensors = {"w@index": index, "w@values": values}
    shares = share_patches([patch], tensors, wants, lambda a: a.reshape(-1).view(np.uint8))
    for w, want in enumerate(wants):
        keep = [
            i
            for i, flat in enumerate(index)
            if any(
                b.contains(Box.of(*((c, c + 1) for c in np.unravel_index(flat, shape))))
                for b in want.regions["w"]
            )
        ]
        assert shares.counts[w] == [len(keep)]
        if not keep:
            assert (w, 0) not in shares.parts
            continue
        got_index, got_values = shares.parts[(w, 0)]
        assert got_index.view("<i4").tolist() == index[keep].tolist()
        assert got_values.reshape(-1).view(np.float32).tolist() == values[keep].tolist()
    assert shares.nbytes == [8 * n for (n,) in shares.counts]


def test_verify_keeps_a_sliced_sessions_delta_rounds_dense(caplog) -> None:
    """``verify=True`` compares each round's slices (vllm-diff mode), which a delta round
    does not send: with ``delta="auto"`` the rounds go dense and sliced, said once, and
    verify passes."""
    client = TPClient(TP4)
    tensors: dict[str, Any] = {}
    with opened(client, tensors, delta="auto", verify=True) as engine:
        full = full_tensors(TP4, 1)
        for step in (1, 2):
            if step > 1:
                full = changed(full, step)
            put(tensors, full, "torch")
            with caplog.at_level("INFO", logger="weightwire.trainer.sliced"):
                report = engine.send_weights().verify
            assert client.last_update["sliced"] is True and "patches" not in client.last_update
            assert report is not None and report.mode == "vllm-diff"
            assert_loaded(client, full)
        said = [r.getMessage() for r in caplog.records if "verify=True compares" in r.getMessage()]
        assert len(said) == 1 and "sends dense sliced rounds" in said[0]
