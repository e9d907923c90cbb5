"""Sliced rounds over ``weightwire_tcp``, end to end on CPU: a trainer engine and in-process TCP
workers hosting ``SlicedTP`` ranks (TP 2 and 4, fewer KV heads than ranks, fused qkv /
gate_up, tied head, whole experts split over the ranks). After each round every worker's
parameters equal ``load_weights`` of the full tensors bit for bit, each worker received about
its share of the bytes (counted by the worker), and the trainer sent about one model's bytes,
not one per worker."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.torch_side._sliced_models import SlicedTP
from tests.trainer._sliced_session import (
    EP2,
    TP2,
    TP4,
    as_source,
    assert_loaded,
    assert_shares,
    assert_trainer_script_rounds,
    committed_round,
    cut_link_at,
    fails_keeping,
    full_tensors,
    lands_sliced,
    opened,
    prepacked,
    put,
    run_script,
    share_limit,
    two_process_reports,
)
from tests.trainer._sliced_workers import Config, TPClient
from weightwire.shared.errors import ConfigError
from weightwire.shared.slices import SliceError
from weightwire.trainer import TrainerInitInfo
from weightwire.trainer.verify import VerifyError
from weightwire.vllm_guard.worker import worker_round_stats


@pytest.mark.parametrize("config", [TP2, TP4, EP2], ids=["tp2-tied-kv1", "tp4-kv2", "ep2"])
def test_torch_rounds_send_each_worker_its_slices(config: Config) -> None:
    client = TPClient(config)
    tensors: dict[str, Any] = {}
    with opened(client, tensors) as engine:
        assert client.init_info["sliced"] is True
        dense = sum(a.nbytes for a in full_tensors(config, 0).values())
        for step in (1, 2, 3):
            full = full_tensors(config, step)
            put(tensors, full)
            metrics = engine.send_weights()
            assert client.last_update["sliced"] is True
            assert_loaded(client, full)
            assert_shares(client.received, config, dense)
            # what a vLLM worker answers through collective_rpc (the plugin installs it)
            for rank, engine_r in enumerate(client.engines):
                told = worker_round_stats(SimpleNamespace(weight_transfer_engine=engine_r))
                assert told is not None and told["bytes_received"] == client.received[rank]
            # one model's bytes (replicated KV heads and norms go to each worker that wants
            # them), not world of them
            assert metrics.nbytes <= 1.3 * dense
            assert sum(client.received) == metrics.nbytes
        assert engine.session.slicing.plans.builds == 1  # planned once, reused every round


def test_sliced_off_broadcasts_every_byte() -> None:
    client = TPClient(TP2)
    full = full_tensors(TP2, 1)
    with opened(client, as_source("torch", full), sliced="off") as engine:
        assert "sliced" not in client.init_info
        metrics = engine.send_weights()
        assert "sliced" not in client.last_update
        dense = sum(a.nbytes for a in full.values())
        assert metrics.nbytes >= dense and client.received == [metrics.nbytes] * 2
        assert_loaded(client, full)


def test_workers_without_a_spec_want_everything_and_get_the_broadcast() -> None:
    """A worker that tells no wants (no served checkpoint known: an older hello) wants every
    tensor whole: with no worker wanting less, the rounds are today's broadcast."""
    client = TPClient(TP2, spec=False)
    full = full_tensors(TP2, 1)
    with opened(client, as_source("torch", full)) as engine:
        assert client.init_info["sliced"] is True
        engine.send_weights()
        assert "sliced" not in client.last_update
        assert_loaded(client, full)


def test_bad_wants_are_refused_naming_the_worker_and_tensor(monkeypatch) -> None:
    """A worker whose wants do not fit the round's tensors: the round is refused before any
    call, naming the worker and the tensor."""
    from weightwire.torch_side.worker import sliced

    real = sliced.hello

    def lying(caches: Any, backend: str) -> tuple[bytes, Any]:
        said, wants = real(caches, backend)
        told = json.loads(said)
        told["tensors"]["model.norm.weight"] = [[[0, 999]]]
        return json.dumps(told).encode(), wants

    monkeypatch.setattr(sliced, "hello", lying)
    client = TPClient(TP2)
    full = full_tensors(TP2, 1)
    with opened(client, as_source("torch", full)) as engine:
        with pytest.raises(SliceError, match=r"worker 0's wants.*model\.norm\.weight.*0:999"):
            engine.send_weights()
        assert client.updates == 0


def test_a_failed_sliced_round_leaves_the_previous_weights() -> None:
    """A link lost mid-round (after some workers got their pieces): every worker keeps the
    last committed round's weights exactly."""
    client = TPClient(TP2)
    tensors: dict[str, Any] = {}
    with opened(client, tensors) as engine:
        full, before = committed_round(engine, client, tensors)

        cut_link_at(engine, worker=1, read=20)  # worker 1's link drops mid-round
        put(tensors, full_tensors(TP2, 2))
        fails_keeping(engine, client, before)


@pytest.mark.parametrize(
    ("config", "source"),
    [
        (TP2, "pytree"),
        pytest.param(TP2, "dict", marks=pytest.mark.slow),
        pytest.param(TP4, "dict", marks=pytest.mark.slow),
    ],
    ids=["tp2-tied-kv1-pytree", "tp2-tied-kv1-dict", "tp4-kv2-dict"],
)
def test_jax_rounds_from_an_fsdp_tp_mesh_never_gather(config: Config, source: str) -> None:
    """A JAX trainer on 8 forced host devices (FSDP 4 x TP 2), in a subprocess (XLA_FLAGS
    precede jax's import): 3 sliced rounds from a ``PytreeSource`` (a transform run on the
    shards) or a dict of the arrays, every worker bit-identical to ``load_weights`` of the
    full tensors (checked there), the gather entry points raising throughout, each host copy
    one planned piece, each worker its share of the bytes."""
    world, heads, kv, _, tied = config
    report = run_script(
        "_sliced_jax_trainer.py", str(world), str(heads), str(kv), str(int(tied)), source
    )
    assert report["copies"] > 0
    assert_trainer_script_rounds(report, config)


@pytest.mark.parametrize("source", ["pytree", pytest.param("dict", marks=pytest.mark.slow)])
def test_two_jax_processes_each_send_their_own_shards_pieces(source: str) -> None:
    """2 ``jax.distributed`` processes (4 host devices each, FSDP 4 x TP 2 over the 8, FSDP
    across the processes) in a ``TrainerGroup``, the source a ``PytreeSource`` (a transform
    run on the shards) or a dict of the arrays: 3 sliced rounds, each process sending each
    worker the pieces the plan gives its rank, read from its own addressable shards on its own
    star. Every worker bit-identical to ``load_weights`` of the full tensors (checked in
    process 0); both processes send, each exactly its plan's bytes, every wanted element once
    (the sum is the workers' total); the gather entry points raise throughout and every host
    copy is one piece. A 4th round in which process 1 fails mid-send fails on every worker
    (nothing commits) and on both processes, within the timeouts."""
    reports = two_process_reports("_sliced_jax_processes.py", source)
    dense = reports[0]["dense"]
    for p, report in enumerate(reports):
        assert report["process"] == p
        assert report["whole"] == [] and report["outside"] == [] and report["copies"] > 0
        assert [r["version"] for r in report["rounds"]] == ["1", "2", "3"]
    for r0, r1 in zip(reports[0]["rounds"], reports[1]["rounds"], strict=True):
        plan = r0["rank_bytes"]
        assert plan == r1["rank_bytes"] and r0["worker_bytes"] == r1["worker_bytes"]
        assert sorted(plan) == ["0", "1"]  # both processes send
        assert r0["sent"] == r0["read"] == plan["0"] > 0
        assert r1["sent"] == r1["read"] == plan["1"] > 0
        # every wanted element once: what the workers received is what the plan gives them
        assert r0["received"] == [r0["worker_bytes"][str(w)] for w in range(2)]
        assert sum(r0["received"]) == r0["sent"] + r1["sent"] <= 1.3 * dense
        assert_shares(r0["received"], TP2, dense)
    # round 4: process 1 fails after its first pieces; the workers refuse the round (process 0
    # checked they still hold round 3's weights), both processes raise, neither hangs
    assert reports[1]["failure"] == {"type": "RuntimeError", "error": "process 1 lost its shard"}
    assert reports[0]["failure"]["type"] == "WeightReceiveError"
    assert "PeerLost: trainer sender src 1 of 2: lost rank 0" in reports[0]["failure"]["error"]


def test_two_torch_processes_each_send_their_own_shards_pieces() -> None:
    """2 gloo ranks in a ``TrainerGroup``: the matrices DTensors sharded over both (uneven
    where they do not divide), the rest plain tensors each rank holds whole (known only to
    itself: the ranks tell each other). 3 sliced rounds, both ranks sending their plan's
    bytes, every worker bit-identical to ``load_weights`` of the full tensors (checked in
    rank 0), ``full_tensor`` raising throughout. A 4th round whose start the server refuses
    fails on rank 0 and, told by it, on rank 1 before it sends anything; both keep their
    engines, so a 5th round commits."""
    reports = two_process_reports("_sliced_torch_processes.py")
    for r0, r1 in zip(reports[0]["rounds"], reports[1]["rounds"], strict=True):
        plan = r0["rank_bytes"]
        assert plan == r1["rank_bytes"] and sorted(plan) == ["0", "1"]
        assert r0["sent"] == plan["0"] > 0 and r1["sent"] == plan["1"] > 0
        assert r0["received"] == [r0["worker_bytes"][str(w)] for w in range(2)]
        assert sum(r0["received"]) == r0["sent"] + r1["sent"]
    assert [r["version"] for r in reports[1]["rounds"]] == ["1", "2", "3"]
    # round 4: the server refuses rank 0's start; rank 1 learns it before sending anything and
    # the workers keep round 3's weights (checked in rank 0)
    assert reports[0]["failure"] == {
        "type": "RuntimeError",
        "error": "the server refused the start",
    }
    assert reports[1]["failure"]["type"] == "RoundFailed"
    assert reports[1]["failure"]["error"] == (
        "trainer rank 0 ended the sliced round before its first byte: "
        "RuntimeError: the server refused the start"
    )
    # round 5: no byte of round 4 went out, so every process kept its engine as rank 0 kept
    # its own, and the next round commits on both (was: every process broke its engine)
    assert [reports[0]["after"], reports[1]["after"]] == ["4", "4"], reports


@pytest.mark.parametrize("value", ["on", True, None])
def test_sliced_setting_is_checked(value: object) -> None:
    with pytest.raises(ConfigError, match=r"sliced must be one of 'auto', 'off', got"):
        TrainerInitInfo(backend="weightwire_tcp", sliced=value)  # type: ignore[arg-type]


def test_a_worker_without_a_landing_map_gets_whole_tensors_beside_sliced_ones() -> None:
    """Worker 1's loader is refused (not a plain copy): it wants every tensor whole, gets
    them assembled from pieces and loads them through ``load_weights``; worker 0 still gets
    only its slices."""
    from weightwire.torch_side.worker.landing import LoaderMapRefused

    client = TPClient(TP2)

    def refuse(model: Any, metas: Any, **_: Any) -> Any:
        raise LoaderMapRefused("the test's loader is not a plain copy")

    client.engines[1]._core.caches._record_map = refuse
    client.engines[1]._core.caches.reads_map = lambda metas: refuse(None, metas)
    full = full_tensors(TP2, 1)
    with opened(client, as_source("torch", full)) as engine:
        engine.send_weights()
        assert client.last_update["sliced"] is True
        assert_loaded(client, full)
        dense = sum(a.nbytes for a in full.values())
        assert client.received[1] == dense
        assert client.received[0] <= share_limit(TP2, dense)


def test_a_sliced_round_over_the_stage_budget_lands_in_place_and_overlapped() -> None:
    """``stage_budget_bytes=0``: each piece is written as it lands (the worker reports the
    round in place until its commit); an overlapped round (``wait=False``) is sliced too."""
    client = TPClient(TP4)
    tensors: dict[str, Any] = {}
    with opened(client, tensors, stage_budget_bytes=0, pause_mode="keep") as engine:
        seen: list[str | None] = []
        client.before_finish = lambda: seen.extend(e.round_strategy for e in client.engines)
        for step in (1, 2):
            full = full_tensors(TP4, step)
            put(tensors, full)
            engine.send_weights(wait=False).result(timeout=60)
            assert client.last_update["sliced"] is True
            assert_loaded(client, full)
        assert seen == ["sliced_in_place"] * 8


def test_a_plan_needing_another_trainer_process_is_refused() -> None:
    """One sending process: a shard only another process holds is refused by name."""
    from weightwire.shared.meta import ParamMeta
    from weightwire.shared.slices import Box, Wants
    from weightwire.trainer.slice_plan import Held, Holdings
    from weightwire.trainer.sliced import Slicing

    metas = [ParamMeta("w", "float32", (4, 2))]
    wants = Wants({"w": (Box.of((0, 2), (0, 2)),)})
    slicing = Slicing([json.dumps(wants.to_json()).encode()], sender=None)  # type: ignore[arg-type]
    held = Holdings.of({"w": (4, 2)}, [Held("w", 1, Box.of((0, 4), (0, 2)))])
    with pytest.raises(
        ConfigError, match=r"process\(es\) \[1\], not by this one \(0\).*sliced='off'"
    ):
        slicing.plan(metas, held, rank=0)


@pytest.mark.parametrize(
    ("hello", "match"),
    [
        (b"{not json", "worker 0's wants are not JSON"),
        (b'{"tensors": {"w": [[[0, 2]]]}, "whole_reason": null}', "worker 0's wants.*'w'.*box"),
        (b'{"tensors": {}, "extra": 1}', "worker 0's wants: wants must be an object"),
    ],
)
def test_malformed_hellos_are_refused_naming_the_worker(hello: bytes, match: str) -> None:
    from weightwire.shared.meta import ParamMeta
    from weightwire.trainer.sliced import parse_wants

    with pytest.raises(SliceError, match=match):
        parse_wants(hello, [ParamMeta("w", "float32", (4, 2))], 0)


def test_verify_checks_sliced_rounds_against_the_workers_shards() -> None:
    """``verify=True`` on a sliced session against a checker of vLLM shards (vllm-diff mode):
    each round's digests are those of the slices sent; from the second round on a parameter
    fed only by unchanged slices must not change, and one that changed is caught."""
    client = TPClient(TP4)
    tensors: dict[str, Any] = {}
    with opened(client, tensors, verify=True) as engine:
        for step in (1, 2):
            full = full_tensors(TP4, step)
            put(tensors, full)
            report = engine.send_weights().verify
            assert client.last_update["sliced"] is True
            assert report.mode == "vllm-diff"
        assert "every parameter fed by changed tensors changed" in report.proves
        # the same weights again, but worker 2's norm changes behind the round's back
        client.after_finish = lambda: client.models[2].norm.weight.data.add_(1.0)
        with pytest.raises(VerifyError, match=r"same bytes as last round.*tp2:model\.norm\.weight"):
            engine.send_weights()


def test_several_trainer_processes_keep_broadcasting(caplog) -> None:
    """A source shared by several trainer processes (their passes gather through
    collectives): rounds stay broadcasts, said once; nothing hangs or is refused."""
    client = TPClient(TP2)
    full = full_tensors(TP2, 1)
    with opened(client, as_source("torch", full)) as engine:
        engine.process_count = lambda: 2
        with caplog.at_level("INFO", logger="weightwire.trainer.sliced"):
            engine.send_weights()
            engine.send_weights()
        assert "sliced" not in client.last_update
        assert_loaded(client, full)
        told = [r for r in caplog.records if "several trainer processes" in r.getMessage()]
        assert len(told) == 1


def test_a_worker_refuses_a_sliced_round_that_leaves_out_part_of_its_slice(monkeypatch) -> None:
    """A trainer that sends a worker less than the slice it told (here: one piece dropped):
    the worker refuses the update once its last piece landed, before anything applies; every
    worker keeps the previous weights."""
    from weightwire.trainer import sliced

    client = TPClient(TP2)
    tensors: dict[str, Any] = {}
    with opened(client, tensors) as engine:
        full, before = committed_round(engine, client, tensors)
        real = sliced.pieces

        def short(*args: Any, **kw: Any) -> Any:
            for i, group in enumerate(real(*args, **kw)):
                yield group[1:] if i == 0 else group  # the first tensor loses a piece

        monkeypatch.setattr(sliced, "pieces", short)
        monkeypatch.setattr("weightwire.trainer.sole_round.pieces", short)
        put(tensors, full_tensors(TP2, 2))
        fails_keeping(engine, client, before, r"brought \d+ of the \d+ elements of")


class SteppedNorm(SlicedTP):
    """Loads the norm as two stepped copies (even, then odd elements): views that are not
    boxes, so this worker wants the norm whole and lands it through the map whole."""

    def load_weights(self, weights: Any) -> set[str]:
        rest = []
        for name, t in weights:
            if name == "model.norm.weight":
                self.norm.weight.data[::2].copy_(t[::2])
                self.norm.weight.data[1::2].copy_(t[1::2])
            else:
                rest.append((name, t))
        return super().load_weights(rest) | {"model.norm.weight"}


def test_a_tensor_whose_loader_reads_no_box_lands_whole_beside_sliced_ones() -> None:
    def stepped(config: Config, rank: int) -> SlicedTP:
        world, heads, kv, ep, tied = config
        torch.manual_seed(rank)
        return SteppedNorm(
            rank=rank, world=world, heads=heads, kv_heads=kv, tied=tied, expert_parallel=ep
        )

    client = TPClient(TP2, model=stepped)
    tensors: dict[str, Any] = {}
    with opened(client, tensors) as engine:
        for step in (1, 2):
            lands_sliced(engine, client, tensors, step)


def test_a_worker_that_processes_weights_after_loading_still_gets_only_its_slices() -> None:
    """A model whose modules process their weights after loading (a CPU vLLM's prepack) has
    no landing map to write through, but its loader's reads are still recorded: it gets only
    its slices, placed in full-shaped tensors for its own ``load_weights``."""

    client = TPClient(TP2, model=prepacked)
    tensors: dict[str, Any] = {}
    with opened(client, tensors) as engine:
        dense = 0
        for step in (1, 2):
            full = full_tensors(TP2, step)
            dense = sum(a.nbytes for a in full.values())
            put(tensors, full)
            engine.send_weights()
            assert client.last_update["sliced"] is True
            assert_loaded(client, full)
            assert_shares(client.received, TP2, dense)


def test_verify_against_a_checker_of_whole_tensors_keeps_the_broadcast(caplog) -> None:
    """A checker keyed by checkpoint names (digest mode: sha256 of whole tensors, as the
    reference server answers) can only be matched by whole tensors: the rounds of a sliced
    session stay broadcasts there, said once, and verify passes."""
    import hashlib

    full = full_tensors(TP2, 1)

    class WholeChecker(TPClient):
        def weight_checker(self, action: str) -> list[dict[str, Any]]:
            sums = {n: hashlib.sha256(a.tobytes()).hexdigest() for n, a in full.items()}
            return [{"checksums": sums}]

    client = WholeChecker(TP2)
    with opened(client, as_source("torch", full), verify=True) as engine:
        with caplog.at_level("INFO", logger="weightwire.trainer.sliced"):
            report = engine.send_weights().verify
        assert "sliced" not in client.last_update and report.mode == "digest"
        assert any("checker of whole tensors" in r.getMessage() for r in caplog.records)
        assert_loaded(client, full)
