"""``weightwire_ipc`` write-through on CPU: the landing table message and its checks, the
copies planned from it, the mode negotiation, the trainer's data path against a scripted
worker on a real control channel (fake CUDA runtime), and the worker's fallback decision.

The bytes themselves (JAX and torch trainers into a vLLM-laid-out model, every wire dtype,
casts, fused and tied parameters, MoE experts, a trainer killed mid-round) are checked on a
GPU: ``tests/gpu/test_ipc_write_through_gpu.py``.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from tests.backends.ipc_through_worker import ThroughWorker
from tests.backends.test_ipc_pull_worker import cp  # noqa: F401  (the fake CUDA fixture)
from tests.trainer.ipc_pull_worker import PullCupy
from tests.trainer.test_ipc_pipeline import FakePacker
from tests.trainer.test_ipc_pull import _join
from weightwire.backends.base import Outgoing, RoundSender
from weightwire.backends.ipc.channel import Channel
from weightwire.backends.ipc.link import IPCSenderComm
from weightwire.backends.ipc.slots import IPCSlots
from weightwire.backends.ipc.through import table as through_table
from weightwire.backends.ipc.through.pipeline import IPCWriteThroughPipeline
from weightwire.backends.ipc.through.table import (
    PART_LANDINGS,
    Alloc,
    Land,
    LandingTable,
    ParamSlot,
    Run,
    TensorLands,
    plan_copies,
    read_table,
    refusal_message,
    table_messages,
)
from weightwire.backends.ipc.trainer import choose_mode
from weightwire.backends.worker_base import LandingRecord
from weightwire.shared.errors import TransferError
from weightwire.shared.framing import plan
from weightwire.shared.meta import ParamMeta
from weightwire.trainer import TrainerInitInfo
from weightwire.trainer.caps import ClientCaps
from weightwire.trainer.gating import round_pause

H = (7).to_bytes(8, "little") + bytes(range(8, 64))  # maps at 70_000 (a uint64 pointer)


def _fused() -> tuple[list[ParamMeta], LandingTable]:
    """q (4x8) and k (2x8) into a fused qkv (6x8) parameter, a norm into its own, bf16."""
    metas = [
        ParamMeta("q", "bfloat16", (4, 8)),
        ParamMeta("k", "bfloat16", (2, 8)),
        ParamMeta("norm", "bfloat16", (8,)),
    ]
    params = (ParamSlot("qkv", 0, 0, 96, "bfloat16"), ParamSlot("norm.w", 0, 512, 16, "bfloat16"))
    tensors = (
        TensorLands("q", (Land(0, (4, 8), 0, (8, 1), 0, (8, 1)),)),
        TensorLands("k", (Land(0, (2, 8), 0, (8, 1), 32, (8, 1)),)),
        TensorLands("norm", (Land(1, (8,), 0, (1,), 0, (1,)),)),
    )
    return metas, LandingTable((Alloc(H, 1024),), params, tensors)


def _read(msgs: list[dict[str, Any]], metas: list[ParamMeta]) -> LandingTable:
    rest = iter(msgs[1:])
    return read_table(msgs[0], lambda: next(rest), metas, "worker 1")


# -- the table --------------------------------------------------------------------------------


def test_a_table_round_trips_through_its_messages_and_plans_one_run_per_slice() -> None:
    metas, table = _fused()
    (msg,) = table_messages(table, 3)
    assert msg["op"] == "land" and msg["t"] == 3 and msg["parts"] == 1
    assert _read([msg], metas) == table
    runs = [c.runs for c in plan_copies(table, metas)]
    # q at the start of qkv, k 32 elements (64 bytes) in, norm at its own storage
    assert runs == [(Run(0, 0, 0, 64),), (Run(0, 0, 64, 32),), (Run(0, 0, 512, 16),)]


def test_a_large_table_is_split_into_parts_and_read_back_whole() -> None:
    n = PART_LANDINGS + 5
    metas = [ParamMeta(f"e{i}", "float32", (4,)) for i in range(n)]
    tensors = tuple(TensorLands(f"e{i}", (Land(0, (4,), 0, (1,), 4 * i, (1,)),)) for i in range(n))
    table = LandingTable((Alloc(H, 16 * n),), (ParamSlot("w", 0, 0, 16 * n, "float32"),), tensors)
    msgs = table_messages(table, 0)
    assert [m["op"] for m in msgs] == ["land", "land_part"] and msgs[0]["parts"] == 2
    assert _read(msgs, metas) == table


def _mutate(msg: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    import copy

    out = copy.deepcopy(msg)
    node: Any = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return out


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        (("tensors", 0, 1, 0, 2), 1, "reads past the end of 'q'"),  # q is 32 elements
        (("tensors", 1, 1, 0, 4), 50, "writes 'k' past the end of 'qkv'"),
        (("tensors", 0, 0), "k", "lists \"k\" where the round has 'q'"),
        (("tensors", 2, 1, 0, 0), 5, "has 0=5, outside"),
        (("params", 1, 2), 1020, "puts parameter 'norm.w' past the end of allocation 0"),
        (("params", 0, 4), "int32", "lands 'q' (bfloat16) in 'qkv' (int32): a cast"),
        (("params", 0, 4), "complex64", "not a wire dtype"),
        (("allocs", 0, 0), "AAAA", "allocation 0"),
        (("tensors", 0, 1, 0, 3), [8], "malformed source strides of 'q'"),
        (("tensors", 0, 1, 0, 1), [4, -8], "malformed shape"),
        (("parts",), 0, "has parts=0"),
    ],
)
def test_a_bad_table_is_refused_naming_what_is_wrong(
    path: tuple[Any, ...], value: Any, needle: str
) -> None:
    metas, table = _fused()
    (msg,) = table_messages(table, 0)
    with pytest.raises(TransferError, match="worker 1's landing table") as err:
        _read([_mutate(msg, path, value)], metas)
    assert needle in str(err.value), str(err.value)


def test_a_table_for_another_round_is_refused() -> None:
    metas, table = _fused()
    (msg,) = table_messages(table, 0)
    with pytest.raises(TransferError, match="lists 3 tensors for a round of 4"):
        _read([msg], [*metas, ParamMeta("v", "bfloat16", (2, 8))])
    with pytest.raises(TransferError, match="has no list 'tensors' of at most 2 entries"):
        _read([msg], metas[:2])


def test_strided_casting_and_column_slices_are_planned_as_kernel_copies_or_runs() -> None:
    metas = [
        ParamMeta("wide", "bfloat16", (4, 512)),  # a column slice: 4 runs of 256 elements
        ParamMeta("narrow", "bfloat16", (64, 8)),  # 8-element rows: too short to run
        ParamMeta("t", "bfloat16", (8, 4)),  # transposed into the parameter
        ParamMeta("f", "float32", (16,)),  # a float32 tensor into a bfloat16 parameter
    ]
    params = (ParamSlot("p", 0, 0, 1 << 16, "bfloat16"),)
    lands = [  # each into its own elements of p
        Land(0, (4, 256), 256, (512, 1), 0, (1024, 1)),
        Land(0, (64, 8), 0, (8, 1), 4096, (16, 1)),
        Land(0, (8, 4), 0, (4, 1), 6144, (1, 8)),
        Land(0, (16,), 0, (1,), 8192, (1,)),
    ]
    table = LandingTable(
        (Alloc(H, 1 << 16),),
        params,
        tuple(TensorLands(m.name, (x,)) for m, x in zip(metas, lands, strict=True)),
    )
    assert _read(table_messages(table, 0), metas) == table
    wide, narrow, t, f = plan_copies(table, metas)
    assert wide.runs == tuple(Run(2 * (256 + 512 * i), 0, 2 * 1024 * i, 512) for i in range(4))
    assert not wide.strided
    assert not narrow.runs and narrow.strided[0].shape == (64, 8)
    assert not t.runs and t.strided[0].dst_strides == (1, 8)
    assert not f.runs and (f.strided[0].src_dtype, f.strided[0].dst_dtype) == (
        "float32",
        "bfloat16",
    )


def _one_param(metas: list[ParamMeta], holds: int, *lands: Land) -> LandingTable:
    """Each of ``metas`` landed by the landing beside it, all into one float32 parameter."""
    return LandingTable(
        (Alloc(H, 4 * holds),),
        (ParamSlot("p", 0, 0, 4 * holds, "float32"),),
        tuple(TensorLands(m.name, (x,)) for m, x in zip(metas, lands, strict=True)),
    )


def test_a_view_that_repeats_elements_is_refused_before_any_copy_is_planned() -> None:
    """A 3 KB table once planned 4.2 M runs (+492 MiB): 64 landings of a 128-element
    tensor read 65536 times over (source stride 0), written as often onto one row."""
    metas = [ParamMeta("w", "float32", (128,))]
    repeat = Land(0, (65536, 128), 0, (0, 1), 0, (0, 1))
    table = LandingTable(
        (Alloc(H, 512),),
        (ParamSlot("p", 0, 0, 512, "float32"),),
        (TensorLands("w", (repeat,) * 64),),
    )
    msgs = table_messages(table, 0)
    assert len(json.dumps(msgs)) < 4096
    with pytest.raises(TransferError) as err:
        _read(msgs, metas)
    assert str(err.value) == (
        "worker 1's landing table reads elements of 'w' more than once in one landing "
        "(source strides [0, 1] for shape [65536, 128])"
    )
    big = [ParamMeta("w", "float32", (1024, 128))]
    onto_one_row = _one_param(big, 1 << 17, Land(0, (1024, 128), 0, (128, 1), 0, (0, 1)))
    with pytest.raises(TransferError, match="writes elements of 'p' more than once in one landing"):
        _read(table_messages(onto_one_row, 0), big)
    # Overlapping dims are a repeat too, however the strides are ordered.
    folded = _one_param(big, 1 << 17, Land(0, (1024, 128), 0, (128, 1), 0, (64, 1)))
    with pytest.raises(TransferError, match="destination strides \\[64, 1\\]"):
        _read(table_messages(folded, 0), big)


def test_landings_that_write_one_element_twice_are_refused() -> None:
    metas, table = _fused()
    (msg,) = table_messages(table, 0)
    with pytest.raises(TransferError) as err:  # k's rows start inside q's
        _read([_mutate(msg, ("tensors", 1, 1, 0, 4), 16)], metas)
    assert str(err.value) == (
        "worker 1's landing table writes elements of 'qkv' twice (landings of 'q' and 'k' overlap)"
    )
    two = [ParamMeta("a", "float32", (8,)), ParamMeta("b", "float32", (8,))]
    both = _one_param(two, 8, Land(0, (8,), 0, (1,), 0, (1,)), Land(0, (8,), 0, (1,), 0, (1,)))
    with pytest.raises(TransferError, match="writes 16 elements into 'p', which holds 8"):
        _read(table_messages(both, 0), two)


def test_interleaved_column_slices_are_checked_run_by_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two halves of each row of a 4 x 16 parameter: their spans interleave, their
    elements do not; shifted by 4 columns they do."""
    halves = [ParamMeta("left", "float32", (4, 8)), ParamMeta("right", "float32", (4, 8))]
    left = Land(0, (4, 8), 0, (8, 1), 0, (16, 1))
    table = _one_param(halves, 64, left, Land(0, (4, 8), 0, (8, 1), 8, (16, 1)))
    assert _read(table_messages(table, 0), halves) == table
    shifted = _one_param(halves, 64, left, Land(0, (4, 8), 0, (8, 1), 4, (16, 1)))
    with pytest.raises(TransferError, match="landings of 'left' and 'right' overlap"):
        _read(table_messages(shifted, 0), halves)
    monkeypatch.setattr(through_table, "MAX_CHECK_RUNS", 7)
    with pytest.raises(TransferError, match="interleaves 2 landings in 'p' in more than 7 runs"):
        _read(table_messages(table, 0), halves)


def test_a_refusal_is_one_short_message() -> None:
    msg = refusal_message(4, "x" * 5000)
    assert msg["op"] == "land" and msg["t"] == 4 and len(msg["refused"]) == 2000


# -- the mode --------------------------------------------------------------------------------

ALL = ["write_through", "pull", "push"]


@pytest.mark.parametrize(
    ("asked", "packed", "offers", "mode", "why"),
    [
        ("write_through", True, [ALL, ALL], "write_through", None),
        ("auto", True, [ALL], "write_through", None),
        ("auto", True, [ALL, ["pull", "push"]], "pull", None),
        ("write_through", True, [["pull", "push"]], "pull", "an older weightwire"),
        ("pull", True, [ALL], "pull", None),
        ("push", True, [ALL], "push", None),
        ("write_through", False, [["push"]], "push", "unpacked rounds"),
        ("write_through", True, [["push"]], "push", "an older weightwire"),
    ],
)
def test_the_session_mode_is_the_best_every_worker_takes(
    asked: str, packed: bool, offers: list[list[str]], mode: str, why: str | None
) -> None:
    got, reason = choose_mode(asked, packed, offers)
    assert got == mode
    assert (reason is None) == (why is None) and (why is None or why in str(reason))


@pytest.mark.parametrize("asked", ["write_through", "auto"])
def test_the_hello_negotiates_write_through(monkeypatch: pytest.MonkeyPatch, asked: str) -> None:
    comm, rdv, got = _join(monkeypatch, packed=True, mode=asked, offer=ALL)
    assert comm.mode == "write_through" and got == [{"op": "mode", "mode": "write_through"}]
    assert not rdv.slots.allocated  # no slot ring: the trainer writes into the worker's memory


def test_ipc_mode_takes_write_through_and_auto_and_refuses_others() -> None:
    for mode in ("write_through", "auto"):
        assert TrainerInitInfo(backend="weightwire_ipc", ipc_mode=mode).ipc_mode == mode
    with pytest.raises(ValueError, match="ipc_mode must be one of 'pull', 'push', 'write_thr"):
        TrainerInitInfo(backend="weightwire_ipc", ipc_mode="through")


def test_a_written_through_round_refuses_generation_whatever_its_size() -> None:
    info = TrainerInitInfo(backend="weightwire_ipc")  # a 1 GiB stage budget
    client = type("C", (), {"pause": lambda s, m: None, "resume": lambda s: None})()
    small = {
        "stock_receiver": False,
        "nbytes": 1000,
        "client": client,
        "caps": ClientCaps.of(client),
        "guard": lambda: True,
    }
    assert round_pause(info, None, **small).mode is None  # staged: all or nothing
    pause = round_pause(info, None, in_place=True, **small)
    assert (pause.mode, pause.resume_on_failure, pause.guard) == ("abort", False, True)
    assert IPCWriteThroughPipeline.in_place and not RoundSender.in_place


# -- the trainer's data path -----------------------------------------------------------------


def _setup(
    table: LandingTable | None,
    metas: list[ParamMeta],
    cupy: Any = None,
    slot_bytes: int = 100,
) -> tuple[list, Any, Any, Any]:
    """The trainer's write-through pipeline on ``cupy`` (a ``PullCupy`` by default: its
    log is returned) and a worker holding ``table``."""
    log: list = []
    fake = (cupy or PullCupy)(log)
    slots = IPCSlots(fake, 0, slot_bytes, 2)
    slots.free_memory()
    a, b = socket.socketpair()
    comm = IPCSenderComm(
        fake, slots, [Channel(a, "IPC worker rank 1")], [[11, 12]], [""], False, "write_through"
    )
    worker = ThroughWorker(b, metas, table)
    pipe = IPCWriteThroughPipeline(comm, FakePacker(), timeout=5.0)
    return log, slots, worker, pipe


def _send(pipe: Any, metas: list[ParamMeta], sizes: list[int], worker: Any) -> Any:
    tensors = [(1_000_000 * (i + 1), n) for i, n in enumerate(sizes)]
    chunks = plan(metas, packed=True, buffer_size_bytes=100)
    prepared = [(c, tensors[c.start : c.stop]) for c in chunks]
    return pipe.send(
        Outgoing(prepared, threading.Event(), begin=worker.started.release, metas=metas)
    )


def test_tensors_are_written_into_the_parameters_after_the_go_and_done_follows() -> None:
    metas, table = _fused()
    log, slots, worker, pipe = _setup(table, metas)
    worker.rounds = 3
    worker.start()
    for early in (False, False, True):
        worker.early = early  # the third round's go comes with its start (the table holds)
        assert _send(pipe, metas, [64, 32, 16], worker) == (112, 1)
    worker.join(10)
    ops = [e for e in log if e[0] in ("copy", "wait", "record", "open")]
    base = 10_000 * int.from_bytes(H[:8], "little")
    one_round = [
        ("wait", 11),  # the worker's free event: its model's reads before any write
        ("copy", base, 1_000_000, 64),
        ("copy", base + 64, 2_000_000, 32),
        ("copy", base + 512, 3_000_000, 16),
        ("record", slots.events[0]),
    ]
    assert ops == [("open", int.from_bytes(H[:8], "little"))] + one_round * 3
    assert [m["op"] for m in worker.seen] == ["path", "done", "done", "done"]
    assert worker.seen[0] == {"op": "path", "t": 0, "wt": True}


def _accepted_then_early() -> tuple[list[ParamMeta], list, Any, Any]:
    """The fused set's table accepted in a first round, the worker's next go set to come
    from inside its start: ``(metas, log, worker, pipe)``, the log cleared."""
    metas, table = _fused()
    log, _, worker, pipe = _setup(table, metas)
    worker.rounds = 2
    worker.start()
    assert _send(pipe, metas, [64, 32, 16], worker) == (112, 1)  # the table, accepted
    worker.early = True  # the next round's go comes from inside its start
    log.clear()
    return metas, log, worker, pipe


def _fused_chunks(metas: list[ParamMeta]) -> list[tuple[Any, list[tuple[int, int]]]]:
    """The fused set's (64, 32, 16 bytes) chunks, each with its tensors' (pointer, bytes)."""
    chunks = plan(metas, packed=True, buffer_size_bytes=100)
    tensors = [(1_000_000 * (i + 1), n) for i, n in enumerate([64, 32, 16])]
    return [(c, tensors[c.start : c.stop]) for c in chunks]


def test_a_go_from_inside_the_start_writes_nothing_before_the_start_answered() -> None:
    metas, log, worker, pipe = _accepted_then_early()

    def begin() -> None:
        worker.started.release()  # the start: the worker's go goes out
        time.sleep(0.3)  # the start (and the pause it carries) is still out
        log.append(("begun",))

    out = Outgoing(_fused_chunks(metas), threading.Event(), begin=begin, metas=metas)
    assert pipe.send(out) == (112, 1)
    worker.join(10)
    ops = [e[0] for e in log if e[0] in ("begun", "copy")]
    # the worker's go came long before the control plane returned; no write went before it
    assert ops == ["begun", "copy", "copy", "copy"]


def _until(cond: Any, bound_s: float) -> None:
    """Poll ``cond`` until it holds or ``bound_s`` passed."""
    deadline = time.monotonic() + bound_s
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)


@pytest.mark.parametrize("go_accepts", [True, False], ids=["one_server", "several_servers"])
def test_one_servers_gos_accept_the_round_and_its_first_write_goes_before_the_start_answered(
    go_accepts: bool,
) -> None:
    metas, log, worker, pipe = _accepted_then_early()

    def begin() -> None:
        worker.started.release()  # the start: the worker's go goes out
        # the start's answer is still out: until the first write (bounded), or a while
        _until(lambda: any(e[0] == "copy" for e in log), 10.0 if go_accepts else 0.3)
        log.append(("begun",))

    out = Outgoing(
        _fused_chunks(metas),
        threading.Event(),
        begin=begin,
        metas=metas,
        go_accepts=go_accepts,
    )
    assert pipe.send(out) == (112, 1)
    worker.join(10)
    ops = [e[0] for e in log if e[0] in ("begun", "copy")]
    if go_accepts:  # the go is the acceptance: written while the start's answer is out
        assert ops == ["copy", "copy", "copy", "begun"] and out.wrote_early.is_set()
    else:  # a go from one server's start says nothing of another's: the answer first
        assert ops == ["begun", "copy", "copy", "copy"] and not out.wrote_early.is_set()
    assert [m["op"] for m in worker.seen] == ["path", "done", "done"]  # done after the start


@pytest.mark.parametrize("early", [True, False], ids=["go_at_start", "go_with_update"])
def test_a_round_in_one_request_is_accepted_at_any_go_and_says_it_heard_the_workers(
    early: bool,
) -> None:
    """``Outgoing.one_request`` (``routes.UPDATE_STARTS``): every word of the round comes from
    inside the one request, so the worker's go accepts it whether it came from its start or
    (its table offered again, say) its update: written before ``begin`` returned, once
    ``heard`` was told; nothing before the go."""
    metas, table = _fused()
    log, _, worker, pipe = _setup(table, metas)
    worker.rounds = 2
    worker.start()
    assert _send(pipe, metas, [64, 32, 16], worker) == (112, 1)  # the table, accepted
    worker.early = early
    log.clear()

    def begin() -> None:  # the request: answered only once the round committed
        worker.started.release()
        _until(lambda: any(e[0] == "copy" for e in log), 10.0)
        log.append(("begun",))

    out = Outgoing(
        _fused_chunks(metas),
        threading.Event(),
        begin=begin,
        metas=metas,
        one_request=True,
        heard=lambda: log.append(("heard",)),
    )
    assert pipe.send(out) == (112, 1)
    worker.join(10)
    ops = [e[0] for e in log if e[0] in ("begun", "copy", "heard")]
    assert ops == ["heard", "copy", "copy", "copy", "begun"]
    assert [m["op"] for m in worker.seen] == ["path", "done", "done"]


def _logged_round(order: list[str]) -> tuple[Any, Any, Any, Callable[[], Any], Callable[[], None]]:
    """A started round's set-up whose first steps land in ``order``: ``(metas, worker, pipe,
    prepared, begin)``; ``prepared()`` logs "chunk read" per chunk it yields (three tensors in
    chunks of 100 bytes), ``begin`` logs "begin" and lets the worker's start through."""
    metas, table = _fused()
    _, _, worker, pipe = _setup(table, metas)
    worker.start()
    chunks = plan(metas, packed=True, buffer_size_bytes=100)
    tensors = [(1_000_000 * (i + 1), n) for i, n in enumerate([64, 32, 16])]

    def prepared() -> Any:
        for c in chunks:
            order.append("chunk read")
            yield c, tensors[c.start : c.stop]

    def begin() -> None:
        order.append("begin")
        worker.started.release()

    return metas, worker, pipe, prepared, begin


def test_the_start_is_released_once_the_first_chunk_was_made_before_begin_runs() -> None:
    """The first chunk's tensors are read from the source, then the start is released (its
    staging and ``begin`` follow): a source that fails on its first tensors lets no start
    out."""
    order: list[str] = []
    metas, worker, pipe, prepared, begin = _logged_round(order)
    out = Outgoing(
        prepared(), threading.Event(), begin=begin, metas=metas, ready=lambda: order.append("ready")
    )
    assert pipe.send(out) == (112, 1)
    worker.join(10)
    assert order[:2] == ["chunk read", "ready"] and order.count("begin") == 1
    assert order.index("ready") < order.index("begin")


def test_the_one_request_leaves_from_the_data_paths_thread_before_its_first_regions() -> None:
    """``Outgoing.request`` (a round of one request): called once, on the data path's own
    thread, after the first chunk was made and the start released, before that chunk's
    regions are taken and before ``begin`` runs on its helper."""
    order: list[str] = []
    threads: list[int] = []
    metas, worker, pipe, prepared, begin = _logged_round(order)

    def request() -> None:
        threads.append(threading.get_ident())
        order.append("request")

    regions = pipe._packer.regions

    def regions_taken(*a: Any, **k: Any) -> Any:
        order.append("regions")
        return regions(*a, **k)

    pipe._packer.regions = regions_taken
    out = Outgoing(
        prepared(),
        threading.Event(),
        begin=begin,
        metas=metas,
        ready=lambda: order.append("ready"),
        request=request,
    )
    assert pipe.send(out) == (112, 1)
    worker.join(10)
    assert order[:3] == ["chunk read", "ready", "request"] and order.count("request") == 1
    assert order.index("request") < order.index("regions")
    assert order.index("request") < order.index("begin")
    assert threads == [threading.get_ident()]


def test_a_source_failing_on_its_first_tensors_releases_no_start() -> None:
    """The main thread fails making its first chunk: no start was released and ``begin`` never
    ran (no server opened a round; a worker written through from its start would refuse
    generation until a whole round commits), and the next round goes through."""
    metas, table = _fused()
    _, _, worker, pipe = _setup(table, metas)
    worker.start()
    order: list[str] = []

    def failing() -> Any:
        raise RuntimeError("the source broke on its first tensor")
        yield  # a generator

    out = Outgoing(
        failing(),
        threading.Event(),
        begin=lambda: order.append("begin"),
        metas=metas,
        ready=lambda: order.append("ready"),
        request=lambda: order.append("request"),  # a round of one request: it stays unsent
    )
    with pytest.raises(RuntimeError, match="broke on its first tensor"):
        pipe.send(out)
    assert order == []
    pipe.settle()
    assert _send(pipe, metas, [64, 32, 16], worker) == (112, 1)
    worker.join(10)


@pytest.mark.parametrize("last", ["done", "running", "device_error"])
def test_the_last_rounds_copies_are_settled_before_the_next_start_can_go(last: str) -> None:
    """A round written through to every worker leaves its fill stream unsettled (the
    workers' commits wait for it). The next round settles it before its start can go (the
    first chunk is made, ``ready``): long done, one query of the event behind its copies and
    no wait; still running, a wait; failing on the device, the round fails naming it with no
    start released and ``begin`` never run (no server opened a round)."""
    metas, table = _fused()
    _, _, worker, pipe = _setup(table, metas)
    worker.rounds = 2
    worker.start()
    assert _send(pipe, metas, [64, 32, 16], worker) == (112, 1)
    order: list[str] = []
    runtime = pipe._comm.cp.cuda.runtime
    runtime.eventQuery = lambda e: (order.append("query"), 0 if last == "done" else 600)[1]
    settle = pipe.settle

    def settling() -> None:
        order.append("settle")
        if last == "device_error":
            raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")
        settle()

    pipe.settle = settling

    def begin() -> None:
        order.append("begin")
        worker.started.release()

    def prepared() -> Any:
        for chunk in _fused_chunks(metas):
            order.append("chunk read")
            yield chunk

    out = Outgoing(
        prepared(), threading.Event(), begin=begin, metas=metas, ready=lambda: order.append("ready")
    )
    if last == "device_error":
        with pytest.raises(RuntimeError, match="illegal memory access") as got:
            pipe.send(out)
        assert "this round sent nothing (no start)" in "".join(got.value.__notes__)
        assert order == ["query", "settle"]  # no chunk read, no start released, no begin
        return
    assert pipe._unsettled is None
    assert pipe.send(out) == (112, 1)
    worker.join(10)
    waited = ["settle"] if last == "running" else []
    assert order[: 3 + len(waited)] == ["query", *waited, "chunk read", "ready"]
    assert "settle" not in order[3 + len(waited) :]


def test_copies_that_never_end_fail_the_next_round_once_without_a_second_wait() -> None:
    """The last round's copies still running past the timeout: the next round fails before
    its start, naming the fill stream; the failed round's own settle (``Transfer``: nothing
    went out) fails at once with that error instead of waiting out the timeout again."""
    metas, table = _fused()
    _, _, worker, pipe = _setup(table, metas)
    worker.start()
    assert _send(pipe, metas, [64, 32, 16], worker) == (112, 1)
    pipe._timeout = 0.2
    pipe._comm.cp.cuda.runtime.eventQuery = lambda e: 600  # never done
    waits: list[float] = []

    class Stuck:  # the fill stream's sync event: never done
        done = False

        def __init__(self, **_: Any) -> None:
            waits.append(time.monotonic())

        def record(self, stream: Any) -> None:
            pass

    pipe._comm.cp.cuda.Event = Stuck
    out = Outgoing(_fused_chunks(metas), threading.Event(), begin=lambda: None, metas=metas)
    with pytest.raises(TransferError, match="the IPC fill stream did not finish") as got:
        pipe.send(out)
    assert "this round sent nothing (no start)" in "".join(got.value.__notes__)
    pipe._timeout = 30.0  # a second wait would now be plain: 30 s, not the 0.2 s above
    began = time.monotonic()
    with pytest.raises(TransferError) as again:
        pipe.settle()
    assert again.value is got.value and time.monotonic() - began < 5.0
    assert len(waits) == 1


def test_a_go_that_came_with_the_update_is_no_acceptance() -> None:
    """One server, but the worker's go came from its update (its table was new this round):
    the start answered long before; nothing is marked as written early."""
    metas, table = _fused()
    _, _, worker, pipe = _setup(table, metas)
    worker.start()
    out = Outgoing(
        _fused_chunks(metas),
        threading.Event(),
        begin=worker.started.release,
        metas=metas,
        go_accepts=True,
    )
    assert pipe.send(out) == (112, 1)
    worker.join(10)
    assert not out.wrote_early.is_set()


class KernelCupy(PullCupy):
    """``PullCupy`` with NVRTC: the gather kernel compiles, each launch is logged, a table's
    upload is a copy into device memory below the parameters (at 5)."""

    uint64 = np.uint64

    def __init__(self, log: list) -> None:
        super().__init__(log)
        self.log = log
        self.cuda.alloc_pinned_memory = lambda n: bytearray(n)
        self.cuda.runtime.eventQuery = lambda e: 0

    def RawKernel(self, source: str, name: str) -> Any:  # CuPy's name
        log = self.log

        class Kernel:
            def compile(self) -> None:
                pass

            def __call__(self, grid: Any, block: Any, args: Any, stream: Any = None) -> None:
                log.append(("launch", name))

        return Kernel()

    def empty(self, n: int, dtype: Any = None) -> Any:
        return type("A", (), {"data": type("D", (), {"ptr": 5})()})()


def _nine_tensors() -> tuple[int, list[ParamMeta], list, list, list, Any, Any]:
    """Nine 16-byte tensors, each its own parameter, one packed chunk (its copies one gather
    table); the worker started: ``(n, metas, chunks, tensors, log, worker, pipe)``."""
    n = 9
    metas = [ParamMeta(f"t{i}", "uint8", (16,)) for i in range(n)]
    params = tuple(ParamSlot(f"p{i}", 0, 64 * i, 16, "uint8") for i in range(n))
    lands = tuple(TensorLands(f"t{i}", (Land(i, (16,), 0, (1,), 0, (1,)),)) for i in range(n))
    table = LandingTable((Alloc(H, 64 * n),), params, lands)
    log, _, worker, pipe = _setup(table, metas, KernelCupy, slot_bytes=1000)
    worker.start()
    chunks = plan(metas, packed=True, buffer_size_bytes=1000)
    tensors = [(1_000_000 * (i + 1), 16) for i in range(n)]
    return n, metas, chunks, tensors, log, worker, pipe


def test_a_refused_start_writes_nothing_though_the_go_came_and_the_next_round_lands() -> None:
    # nine small tensors, each its own parameter: the first chunk's copies are one gather
    # table, staged (planned, uploaded) while the start is out
    n, metas, chunks, tensors, log, worker, pipe = _nine_tensors()

    def send(begin: Any) -> Any:
        prepared = [(c, tensors[c.start : c.stop]) for c in chunks]
        return pipe.send(Outgoing(prepared, threading.Event(), begin=begin, metas=metas))

    assert send(worker.started.release) == (16 * n, 1)  # the table, accepted
    worker.join(10)
    assert [e for e in log if e[0] == "launch"] == [("launch", "weightwire_gather")]
    params_at = 70_000  # where the fake maps the parameters' allocation

    def writes() -> list:
        copies = [e for e in log if e[0] == "copy" and e[1] >= params_at]
        return copies + [e for e in log if e[0] == "launch"]

    class Refused(Exception):
        pass

    # The worker's go comes from inside its start, then the start is refused (another
    # replica said no): with everything staged beside the start, still no write.
    ch = worker.ch
    refusal = Refused("start_weight_update: 409 another replica refused the round")

    def refused_begin() -> None:
        ch.send({"op": "go", "t": 0, "early": True})
        time.sleep(0.2)  # the go is read and the chunk staged meanwhile
        raise refusal

    for _ in range(2):
        log.clear()
        with pytest.raises(Refused) as got:
            send(refused_begin)
        assert got.value is refusal  # the start's own error, as without the overlap
        assert writes() == []  # nothing written into the parameters
        pipe.settle()  # what a round that failed before its first byte gets (trainer.transfer)

    # The next round lands: the staged tables were let go (the ring is not held by them).
    def landing_begin() -> None:
        ch.send({"op": "go", "t": 0, "early": True})

    def done() -> None:
        ch.expect("done", deadline=time.monotonic() + 10, what="done")

    waiter = threading.Thread(target=done)
    waiter.start()
    log.clear()
    assert send(landing_begin) == (16 * n, 1)
    waiter.join(10)
    assert not waiter.is_alive()
    assert [e for e in log if e[0] == "launch"] == [("launch", "weightwire_gather")]


def test_one_servers_start_refused_writes_nothing_and_failing_after_the_go_fails() -> None:
    """One server (the gos accept the round): a start refused before its workers' start (no
    go) writes nothing and is no early write; a start that fails after every go (a replica's
    reply lost) was written at the go: its error is the round's, marked as written early."""
    n, metas, chunks, tensors, log, worker, pipe = _nine_tensors()

    def send(begin: Any) -> Outgoing:
        prepared = [(c, tensors[c.start : c.stop]) for c in chunks]
        out = Outgoing(prepared, threading.Event(), begin=begin, metas=metas, go_accepts=True)
        pipe.send(out)
        return out

    send(worker.started.release)  # the table, accepted
    worker.join(10)

    def launches() -> list:
        return [e for e in log if e[0] == "launch"]

    class Refused(Exception):
        pass

    ch = worker.ch
    refusal = Refused("start_weight_update: 409 a weight update is already active")

    def refused_begin() -> None:  # refused by the server's own checks: no worker started
        time.sleep(0.2)
        raise refusal

    log.clear()
    with pytest.raises(Refused) as got:
        send(refused_begin)
    assert got.value is refusal and launches() == []
    pipe.settle()

    lost = Refused("start_weight_update: 500 replica 0's reply was lost")
    outs: list[Outgoing] = []

    def failing_after_the_go() -> None:
        ch.send({"op": "go", "t": 0, "early": True})
        _until(lambda: bool(launches()), 10.0)  # written meanwhile
        raise lost

    log.clear()
    prepared = [(c, tensors[c.start : c.stop]) for c in chunks]
    outs.append(
        Outgoing(
            prepared, threading.Event(), begin=failing_after_the_go, metas=metas, go_accepts=True
        )
    )
    with pytest.raises(Refused) as got:
        pipe.send(outs[0])
    assert got.value is lost  # the start's own error
    assert launches() == [("launch", "weightwire_gather")]  # written at the go
    assert outs[0].wrote_early.is_set()  # the trainer fails the round as after a first byte


def test_a_refusing_worker_gets_its_round_through_its_receive_buffer_and_it_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    metas = [ParamMeta("a", "uint8", (40,))]
    log, slots, worker, pipe = _setup(None, metas)
    worker.start()
    with caplog.at_level(logging.WARNING):
        assert _send(pipe, metas, [40], worker) == (40, 1)
    worker.join(10)
    assert [m["op"] for m in worker.seen] == ["ready"]
    assert [e for e in log if e[0] == "copy"] == [("copy", 10_000 * 100, 1_000_000, 40)]
    assert "lm_head is quantized" in caplog.text and "receive buffers (pull)" in caplog.text


def test_an_early_go_for_another_tables_tensors_is_passed_over_for_the_new_table() -> None:
    metas, table = _fused()
    log, slots, worker, pipe = _setup(table, metas)
    worker.start()
    assert _send(pipe, metas, [64, 32, 16], worker) == (112, 1)
    worker.join(10)
    # the next round carries other tensors: the worker's early go (the last table) is
    # passed over, its new table taken, and the copies follow its go
    other = [ParamMeta("q", "bfloat16", (4, 8)), ParamMeta("k", "bfloat16", (2, 8))]
    table2 = LandingTable(table.allocs, table.params, table.tensors[:2])
    a = worker.ch

    def second() -> None:
        worker.started.acquire(timeout=10)
        a.send({"op": "go", "t": 0, "early": True})
        for msg in table_messages(table2, 1):
            a.send(msg)
        a.expect("path", deadline=time.monotonic() + 10, what="path")
        a.send({"op": "go", "t": 1})
        a.expect("done", deadline=time.monotonic() + 10, what="done")

    thread = threading.Thread(target=second)
    thread.start()
    log.clear()
    assert _send(pipe, other, [64, 32], worker) == (96, 1)
    thread.join(10)
    copies = [e for e in log if e[0] == "copy"]
    assert [c[2:] for c in copies] == [(1_000_000, 64), (2_000_000, 32)]


def test_a_go_for_a_table_the_trainer_never_took_is_refused() -> None:
    metas, table = _fused()
    log, slots, worker, pipe = _setup(table, metas)
    worker.go_table = 9
    worker.start()
    with pytest.raises(TransferError, match="table 9, which this trainer did not accept"):
        _send(pipe, metas, [64, 32, 16], worker)
    assert not [e for e in log if e[0] == "copy"]  # nothing written


# -- the worker's decision -----------------------------------------------------------------------


def test_without_a_landing_map_the_worker_says_why_and_takes_the_pull_path() -> None:
    from weightwire.torch_side.worker.strategy import record_landing

    got = record_landing(object(), [ParamMeta("a", "uint8", (4,))])
    assert isinstance(got, LandingRecord) and got.map is None and got.refused


def test_a_worker_whose_loader_refuses_says_so_once_and_takes_the_pull_path(
    cp: Any,  # noqa: F811  (the fake CUDA fixture)
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import functools

    from tests.backends.ipc_worker_fakes import connect_scripted
    from tests.backends.test_ipc_pull_worker import _round
    from weightwire.backends.ipc import worker as ipc_worker
    from weightwire.backends.ipc.through.worker import IPCWriteThroughLink
    from weightwire.backends.worker_base import ReceiveTurn

    through = functools.partial(ipc_worker.connect_ipc, through=IPCWriteThroughLink)
    monkeypatch.setattr(ipc_worker, "connect_ipc", through)

    def trainer(ch: Channel, hello: dict[str, Any]) -> None:
        ch.send({"op": "mode", "mode": "write_through"})
        ch.send({"op": "ping"})
        ch.expect("pong", deadline=time.monotonic() + 5, what="pong")

    link, ch, hello = connect_scripted(trainer)
    assert hello["modes"] == ALL and isinstance(link, IPCWriteThroughLink)
    metas, chunks = _round([30, 40])
    turn = ReceiveTurn(0, metas, chunks, [], packed=True)
    calls: list[int] = []

    def record() -> LandingRecord:
        calls.append(1)
        return LandingRecord(None, "'lm_head' is quantized: not a plain copy")

    with caplog.at_level(logging.WARNING):
        assert link.lands(turn, record) is False
        assert link.lands(turn, record) is False  # the same tensors: decided once
    msg = ch.recv(deadline=time.monotonic() + 5, what="land")
    assert msg == {"op": "land", "t": 0, "refused": "'lm_head' is quantized: not a plain copy"}
    assert calls == [1] and caplog.text.count("lm_head") == 1
    link.close()


def test_one_server_of_two_workers_writes_at_the_go_only_once_both_went() -> None:
    """The reference server with two replicas (one URL, two workers written through): the
    gos accept the round only once every worker's came from inside its start; one worker's
    go alone writes into neither (the other's start may still fail)."""
    metas, table = _fused()
    log: list = []
    fake = PullCupy(log)
    slots = IPCSlots(fake, 0, 100, 2)
    slots.free_memory()
    ends = [socket.socketpair() for _ in range(2)]
    comm = IPCSenderComm(
        fake,
        slots,
        [Channel(a, f"IPC worker rank {w + 1}") for w, (a, _) in enumerate(ends)],
        [[11, 12], [13, 14]],
        ["", ""],
        False,
        "write_through",
    )
    workers = [ThroughWorker(b, metas, table) for _, b in ends]
    pipe = IPCWriteThroughPipeline(comm, FakePacker(), timeout=5.0)
    for worker in workers:
        worker.rounds = 2
        worker.start()
    chunks = plan(metas, packed=True, buffer_size_bytes=100)
    tensors = [(1_000_000 * (i + 1), n) for i, n in enumerate([64, 32, 16])]

    def both() -> None:
        for worker in workers:
            worker.started.release()

    out = Outgoing([(c, tensors[c.start : c.stop]) for c in chunks], threading.Event(), both, metas)
    assert pipe.send(out) == (112, 1)  # the tables, accepted
    for worker in workers:
        worker.early = True  # the next round's gos come from inside their starts
    log.clear()
    order: list[str] = []

    def begin() -> None:
        workers[0].started.release()  # worker 0's start sent its go; worker 1's is still out
        _until(lambda: any(e[0] == "copy" for e in log), 0.3)
        early = any(e[0] == "copy" for e in log)
        order.append("copies before worker 1's go" if early else "worker 1 goes")
        workers[1].started.release()
        _until(lambda: any(e[0] == "copy" for e in log), 10.0)  # written at both gos
        order.append("begun")

    out = Outgoing(
        [(c, tensors[c.start : c.stop]) for c in chunks],
        threading.Event(),
        begin=begin,
        metas=metas,
        go_accepts=True,
    )
    assert pipe.send(out) == (112, 1)
    for worker in workers:
        worker.join(10)
    assert order == ["worker 1 goes", "begun"]
    assert out.wrote_early.is_set()  # both gos came from inside the start: accepted at them
    assert [e[0] for e in log].count("copy") == 6  # three tensors into each worker


def _empty_round_worker(ch: Channel, answered: threading.Event, started: threading.Event) -> None:
    """A worker of a round of empty tensors with release-after-round, as the real one is:
    no byte, so no table, go or want; its update (and so its server's request) returns
    only once the trainer said it closed its mappings (``unmapped``)."""
    if not started.wait(10):
        return
    try:
        ch.expect("unmapped", deadline=time.monotonic() + 5.0, what="the trainer's unmapped")
    except TransferError:
        return
    answered.set()


@pytest.mark.parametrize("one_request", [False, True], ids=["two_calls", "one_request"])
def test_a_round_of_empty_tensors_never_hears_its_workers_so_it_keeps_its_start_as_a_call(
    one_request: bool,
) -> None:
    """A round with no byte to write (every tensor empty), release-after-round: the data path
    reads no worker's word (none is sent), so ``heard`` is never told. With its start a call
    of its own (what ``trainer.round.writes_a_byte`` picks) ``begin`` returns at the start's
    answer, ``unmapped`` goes and the round ends at once; in one request ``begin`` waits for
    the request, which waits for that ``unmapped``: the round fails on ``http_s``."""
    from weightwire.shared.errors import ControlTimeout
    from weightwire.trainer.metrics import PhaseClock
    from weightwire.trainer.transfer import Transfer

    metas = [ParamMeta("e", "float32", (0,)), ParamMeta("f", "bfloat16", (0, 4))]
    fake = PullCupy([])
    slots = IPCSlots(fake, 0, 100, 2)
    slots.free_memory()
    a, b = socket.socketpair()
    comm = IPCSenderComm(
        fake, slots, [Channel(a, "IPC worker rank 1")], [[11, 12]], [""], True, "write_through"
    )
    pipe = IPCWriteThroughPipeline(comm, FakePacker(), timeout=5.0)
    started, answered = threading.Event(), threading.Event()
    worker = threading.Thread(
        target=_empty_round_worker, args=(Channel(b, "trainer"), answered, started), daemon=True
    )
    worker.start()

    def request() -> None:  # the update (with the start in one request): the worker's answer
        started.set()
        if not answered.wait(10.0):
            raise TimeoutError("the worker never answered")

    step = Transfer(
        comm,
        pipe,
        post_update=request,
        control=started.set,  # two calls: the start reached the worker and answered
        clock=PhaseClock(),
        http_s=0.2,
        finishes=True,
        one_request=one_request,
    )
    chunks = plan(metas, packed=True, buffer_size_bytes=100)
    prepared = [(c, [(1_000_000, 0)] * (c.stop - c.start)) for c in chunks]
    try:
        t0 = time.monotonic()
        if one_request:
            with pytest.raises(ControlTimeout, match="neither answered nor let the workers"):
                step.run(prepared, metas)
            assert not answered.is_set() and step.broken is not None
        else:
            assert step.run(prepared, metas) == (0, len(chunks))
            # at once: not the request's 10 s wait for the worker's answer
            assert answered.is_set() and time.monotonic() - t0 < 5.0 and step.broken is None
    finally:
        answered.set()
        started.set()
        worker.join(10)
        pipe.close()
