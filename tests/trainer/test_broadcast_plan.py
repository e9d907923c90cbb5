"""Several broadcasting ranks, without processes: the plan rules, the wire fields (``src``,
``sources``), the worker receiving each turn from its ``src`` (real TCP stars in
threads; NCCL with a fake communicator), and the trainer-side gates (threads as ranks)."""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import numpy as np
import pytest
import torch

from tests.torch_side.test_engine_rules import ThreadSender, Tiny, send_module
from tests.trainer.fakes import DictSource
from tests.trainer.thread_ranks import run_ranks
from weightwire.backends.tcp.info import TCPInitInfo
from weightwire.shared.meta import ParamMeta
from weightwire.shared.update_info import UpdateInfo
from weightwire.torch_side.sender.source import ModuleSource
from weightwire.torch_side.worker.engines import WeightwireTCPEngine
from weightwire.torch_side.worker.hf_host import HFModelHost
from weightwire.trainer.broadcast_plan import (
    PlanError,
    check_agreement,
    check_holders,
    check_receiver,
    digest,
    plan_broadcast,
)
from weightwire.trainer.config import TrainerInitInfo
from weightwire.trainer.group import DictGroup, Exchange, GroupTimeout

pytestmark = pytest.mark.timeout(60)


def m(name: str, *owners: int) -> ParamMeta:
    return ParamMeta(name, "float32", (2,), owners or None)


# -- plan rules -----------------------------------------------------------------------


def test_plan_group_ranks_and_turns_follow_first_owners() -> None:
    plan = plan_broadcast([m("a.0.x", 0), m("a.0.y", 0, 2), m("a.1.x", 3), m("a.2.x", 5, 4)])
    assert plan.group_ranks == (0, 3, 5) and plan.multi
    assert [(t.rank, t.src, [x.name for x in t.metas]) for t in plan.turns] == [
        (0, 0, ["a.0.x", "a.0.y"]),
        (3, 1, ["a.1.x"]),
        (5, 2, ["a.2.x"]),
    ]
    assert plan.world_size(4) == 7
    # rank 0 owns nothing: it is still group rank 0, with no turn of its own
    plan = plan_broadcast([m("x", 1), m("y", 2)])
    assert (
        plan.group_ranks == (0, 1, 2)
        and [t.src for t in plan.turns] == [1, 2]
        and plan.turn_of(0) is None
    )
    single = plan_broadcast([m("x"), m("y")])
    assert single.group_ranks == (0,) and not single.multi


@pytest.mark.parametrize(
    ("metas", "match"),
    [
        ([m("w", 1, 0)], r"'w' has owners \[1, 0\]: rank 0 gathers only in its own turn"),
        (
            [m("w", 0), m("v"), m("u", 1)],
            r"'v' has no owners \(every rank\), "
            r"but the source has several broadcasting ranks \[0, 1\]",
        ),
        (
            [m("w", 1, 2), m("v", 2)],
            r"rank 2 owns parameters broadcast by ranks 1 and 2 \(at 'v'\)",
        ),
        (
            [m("w", 1), m("v", 2), m("u", 1)],
            r"'u' \(broadcaster rank 1\) follows parameters of rank 2",
        ),
    ],
)
def test_plan_rules_name_the_parameter(metas: list[ParamMeta], match: str) -> None:
    with pytest.raises(PlanError, match=match):
        plan_broadcast(metas)


def test_orphan_name_and_disagreement_name_rank_and_name() -> None:
    plan = plan_broadcast([m("w", 0), m("v", 1), m("u", 1)])
    check_holders(plan, 1, {"v", "u"})
    check_holders(plan, 2, set())  # outside the group: holds nothing, owes nothing
    with pytest.raises(PlanError, match=r"rank 1 is the first owner of 'u' but does not hold it"):
        check_holders(plan, 1, {"v"})
    a, b = digest([m("w", 0), m("v", 1)]), digest([m("w", 0), m("v", 0)])
    check_agreement([a, a, a])
    with pytest.raises(PlanError, match=r"rank\(s\) \[2\] differ from rank 0"):
        check_agreement([a, a, b])


# -- wire fields ----------------------------------------------------------------------


def test_update_info_src_is_omitted_when_zero() -> None:
    names = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]}
    assert UpdateInfo(**names).to_dict() == names  # what a stock vLLM reads
    assert UpdateInfo(**names, src=2).to_dict() == {**names, "src": 2}
    assert UpdateInfo.from_dict({**names, "src": 2}).src == 2
    assert UpdateInfo.from_dict(
        {"names": [], "dtype_names": [], "shapes": [], "src": 1}
    ).reuses_previous
    with pytest.raises(ValueError, match="src must be a group rank"):
        UpdateInfo.from_dict({**names, "src": -1})
    with pytest.raises(ValueError, match="src must be int"):
        UpdateInfo.from_dict({**names, "src": True})


def test_tcp_init_info_lists_every_broadcaster() -> None:
    sender = ThreadSender(lambda comm: None)
    base = {**sender.rdv.init_fields(), "world_size": 4}
    try:
        # More broadcasters than trainer ranks below the workers is refused; a rank_offset past
        # the broadcasters (a later data-parallel server) is not.
        with pytest.raises(
            ValueError,
            match=r"sources lists 1 broadcasting rank\(s\) besides rank 0, but rank_offset 1",
        ):
            TCPInitInfo(**base, rank_offset=1, sources=[sender.rdv.init_fields()])
        assert TCPInitInfo(**base, rank_offset=2).broadcasters == 1
        with pytest.raises(
            ValueError, match=r"sources\[0\] must be an object with exactly host, port, secret_b64"
        ):
            TCPInitInfo(**base, rank_offset=2, sources=[{"host": "h"}])
        info = TCPInitInfo.from_dict(
            {**base, "rank_offset": 2, "sources": [sender.rdv.init_fields()]}
        )
        assert [e[:2] for e in info.endpoints] == [(sender.rdv.host, sender.rdv.port)] * 2
        assert "sources" not in TCPInitInfo(**base, rank_offset=1).to_dict()
    finally:
        sender.rdv.close()


# -- worker: each turn from its src ---------------------------------------------------


def test_worker_receives_each_turn_from_its_src_over_tcp() -> None:
    """Two stars (trainer ranks 0 and 1); the worker dials both and takes each turn from
    its ``src``; a reuse round reuses each src's own metadata; an unknown src is refused."""
    trainer = Tiny(seed=1)
    metas = ModuleSource(trainer).metadata()
    first, second = metas[:-4], metas[-4:]  # rank 0: embed, layers 0-1; rank 1: layer 2, norm
    senders = [
        ThreadSender(_send_subset(Tiny(seed=1), {x.name for x in part}, rounds=2))
        for part in (first, second)
    ]
    engine = WeightwireTCPEngine.standalone(model=HFModelHost(Tiny(seed=5)), device="cpu")
    info = senders[0].info(rank_offset=2, world_size=3, sources=[senders[1].rdv.init_fields()])
    engine.init_transfer_engine(info)
    host = engine.model
    for round_ in (1, 2):
        engine.start_weight_update()
        if round_ == 1:
            engine.update_weights(UpdateInfo.from_metas(first).to_dict())
            engine.update_weights({**UpdateInfo.from_metas(second).to_dict(), "src": 1})
        else:
            engine.update_weights({"names": [], "dtype_names": [], "shapes": []})
            engine.update_weights({"names": [], "dtype_names": [], "shapes": [], "src": 1})
        engine.finish_weight_update()
    for s in senders:
        s.join()
        assert s.error is None
    for name, p in trainer.named_parameters():
        assert torch.equal(host.model.get_parameter(name), p), name
    engine.start_weight_update()
    with pytest.raises(ValueError, match=r"src must be in \[0, 2\)"):
        engine.update_weights({**UpdateInfo.from_metas(second).to_dict(), "src": 2})
    engine.shutdown()


def _send_subset(module: torch.nn.Module, names: set[str], *, rounds: int) -> Any:
    from weightwire.shared.framing import pack_host, plan

    named = [(n, t.detach().numpy().copy()) for n, t in ModuleSource(module) if n in names]
    metas = [x for x in ModuleSource(module).metadata() if x.name in names]

    def script(comm: Any) -> None:
        for _ in range(rounds):
            for chunk in plan(metas, packed=True, buffer_size_bytes=256):
                comm.broadcast(
                    pack_host([a for _, a in named[chunk.start : chunk.stop]], chunk), timeout=20
                )

    return script


def test_single_sender_worker_refuses_src_1() -> None:
    trainer = Tiny(seed=1)
    sender = ThreadSender(send_module(trainer, rounds=0))
    engine = WeightwireTCPEngine.standalone(model=HFModelHost(Tiny(seed=5)), device="cpu")
    engine.init_transfer_engine(sender.info())
    engine.start_weight_update()
    with pytest.raises(ValueError, match="initialized with one broadcasting trainer rank"):
        engine.update_weights(
            {**UpdateInfo.from_metas(ModuleSource(trainer).metadata()).to_dict(), "src": 1}
        )
    sender.join()
    engine.shutdown()


def test_nccl_link_receives_from_the_turns_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """``weightwire_nccl``: one communicator, the turn's ``src`` is the broadcast root."""
    from weightwire.backends.nccl import worker as nccl_worker
    from weightwire.backends.worker_base import ReceiveTurn
    from weightwire.shared.framing import plan

    calls: list[int] = []

    class Comm:
        def broadcast(self, view: Any, *, root: int, timeout: float, stream: Any) -> None:
            calls.append(root)

        def synchronize(self, stream: Any, *, timeout: float) -> None:
            pass

    class Stream:
        cuda_stream = 0

        def __init__(self, device: Any = None) -> None:
            pass

        def wait_stream(self, other: Any) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    monkeypatch.setattr(nccl_worker, "tensor_device_bytes", lambda buf: buf)
    link = nccl_worker.NCCLLink(Comm(), device=torch.device("cpu"), timeout_s=5, depth=2, sources=3)
    metas = [m("w")]
    (chunk,) = plan(metas, packed=True, buffer_size_bytes=64)
    for src in (0, 2, 1):
        link.check_source(src)
        link.post(0, ReceiveTurn(src, metas, [chunk], [], packed=True))
        assert link.wait(0).numel() == chunk.nbytes
    assert calls == [0, 2, 1]
    with pytest.raises(ValueError, match=r"names src 3, .* src must be in \[0, 3\)"):
        link.check_source(3)


# -- trainer side: gates and agreement, threads as ranks -------------------------------


def test_stock_nccl_refuses_several_broadcasters_before_sending() -> None:
    errors, client = run_ranks("nccl", lambda n, r: 0 if ".0." in n else 1)
    for e in errors:
        assert isinstance(e, PlanError) and "receives only from src 0" in str(e), errors
    assert client.calls == []  # nothing posted


def test_ranks_disagreeing_on_owners_all_fail_naming_the_rank() -> None:
    errors, client = run_ranks("weightwire_tcp", lambda n, r: 0 if (".0." in n or r == 1) else 1)
    for e in errors:
        assert isinstance(e, PlanError) and "rank(s) [1] differ from rank 0" in str(e), errors
    assert client.calls == []


def test_exchange_read_is_bounded_and_names_the_rank() -> None:
    group = DictGroup.make(2)[0]
    with pytest.raises(GroupTimeout, match=r"trainer rank 1 did not publish 'x' within 0\.0\d* s"):
        Exchange(group).allgather("x", 1, timeout=0.05)


def test_exchanges_over_separate_group_objects_of_one_store_do_not_collide() -> None:
    """A group object built per engine over the same store: the second engine's
    exchange must not read the first one's keys (its namespace is per store and rank)."""
    first = DictGroup.make(2)
    shared, cv = first[0]._shared, first[0]._cv
    again = [DictGroup(r, 2, shared, cv) for r in range(2)]
    a = [Exchange(g) for g in first]
    b = [Exchange(g) for g in again]
    a[1].post("x", "from engine a")
    with pytest.raises(GroupTimeout):
        b[0].get("x", 1, timeout=0.05)  # engine b's rank 1 has not published yet
    b[1].post("x", "from engine b")
    assert (a[0].get("x", 1, timeout=1.0), b[0].get("x", 1, timeout=1.0)) == (
        "from engine a",
        "from engine b",
    )


def test_group_with_one_broadcaster_uses_the_ordinary_round_and_shares_the_verdict() -> None:
    """All owners unset: rank 0 sends alone (plain payload, no ``src``); rank 1 only
    iterates and returns rank 0's committed version; a refused round fails both ranks."""
    from tests.trainer.fakes import FAKE, FakeComm, FakeServer
    from weightwire.jax_side.dtypes import describe
    from weightwire.jax_side.engine import JAXTrainerEngine
    from weightwire.trainer.multi_source import RoundFailed

    FAKE.comm = FakeComm()
    server = FakeServer()
    groups = DictGroup.make(2)
    tensors = {
        "model.layers.0.w": np.arange(4, dtype=np.float32),
        "model.layers.1.w": np.ones(3, np.float32),
    }
    results: list[Any] = [None, None]
    sources = [DictSource(dict(tensors), describe) for _ in range(2)]

    def rank(r: int, fail: bool) -> None:
        engine = None
        try:
            cfg = TrainerInitInfo(backend="fake_host", rank=r, pause_mode=None)
            engine = JAXTrainerEngine.trainer_init(
                cfg, client=server.client(), source=sources[r], group=groups[r]
            )
            results[r] = [engine.send_weights().version]
            if fail:
                server.fail_route = "update_weights"  # type: ignore[attr-defined]
            results[r].append(engine.send_weights().version)
        except BaseException as exc:  # recorded per rank
            results[r] = [*(results[r] or []), exc]
        finally:
            if engine is not None:  # its beat thread ends with it
                with contextlib.suppress(Exception):
                    engine.shutdown()

    real = server.handler

    def handler(request: Any) -> Any:
        import httpx

        if getattr(server, "fail_route", None) and request.url.path.endswith("/update_weights"):
            return httpx.Response(500, json={"message": "worker exploded"})
        return real(request)

    server.handler = handler  # type: ignore[method-assign]
    threads = [threading.Thread(target=rank, args=(r, r == 0)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert results[0][0] == results[1][0] == "1"
    assert "src" not in server.bodies("update_weights")[0]["update_info"]
    assert sources[1].iterations == 2  # rank 1 iterated both rounds
    assert not isinstance(results[0][1], str) and "worker exploded" in str(results[0][1])
    assert isinstance(
        results[1][1], RoundFailed
    ) and "trainer rank 0 reported the round failed" in str(results[1][1])


def test_receiver_gate() -> None:
    multi, single = plan_broadcast([m("w", 0), m("v", 1)]), plan_broadcast([m("w")])
    check_receiver(single, "nccl", stock=True, several=None)  # src 0 only: any receiver
    check_receiver(multi, "weightwire_tcp", stock=False, several="stars")
    check_receiver(multi, "weightwire_nccl", stock=False, several="group")
    # The backends to use instead are the registry's carriers of several, in its order.
    with pytest.raises(PlanError, match="src 0; use weightwire_tcp or weightwire_nccl, or"):
        check_receiver(multi, "nccl", stock=True, several=None)
    with pytest.raises(
        PlanError,
        match="backend 'weightwire_ipc' carries one broadcaster only; use weightwire_tcp or "
        "weightwire_nccl, or",
    ):
        check_receiver(multi, "weightwire_ipc", stock=False, several=None)


def test_backends_declare_how_they_carry_several_broadcasters() -> None:
    from weightwire.backends import get_backend

    shapes = {
        n: get_backend(n).caps.several
        for n in ("weightwire_tcp", "weightwire_nccl", "nccl", "weightwire_ipc")
    }
    assert shapes == {
        "weightwire_tcp": "stars",
        "weightwire_nccl": "group",
        "nccl": None,
        "weightwire_ipc": None,
    }
