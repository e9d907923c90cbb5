"""``ipc_mode="auto"``, the default: write-through where it is correct, else pull, chosen at the
join. A real rendezvous (fake CUDA) joined by a real worker core through the registry's
connect (fake CUDA): the worker checks at the join whether its model can be written through
and says why not in its hello; a model whose loader computes makes the session pull, with
one trainer log line naming the worker and why; a plain model is written through; explicit
modes are kept; a delta session pulls.

The bytes of each mode are checked on a GPU (``tests/gpu/test_ipc_write_through_gpu.py``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

import pytest
import torch

from tests.backends.test_ipc_pull_worker import cp  # noqa: F401  (the fake CUDA fixture)
from tests.torch_side._landing_models import Refusing
from tests.trainer.ipc_pull_worker import pull_rendezvous
from weightwire.backends.ipc.info import IPCInitInfo
from weightwire.backends.ipc.through.worker import IPCWriteThroughLink
from weightwire.backends.ipc.trainer import choose_mode, session_mode
from weightwire.backends.ipc.worker import IPCPullLink
from weightwire.shared.errors import ConfigError
from weightwire.torch_side.worker.connect import connect
from weightwire.torch_side.worker.core import _ReceiverCore
from weightwire.torch_side.worker.hf_host import HFModelHost
from weightwire.torch_side.worker.spec import ModelSpec, TensorSpec
from weightwire.torch_side.worker.turn import join_landing
from weightwire.trainer import TrainerInitInfo

TRAINER_LOG = "weightwire.backends.ipc.trainer"
COMPUTES = "w.weight: the loader computes on it (aten.mul.Tensor), not a plain copy"


class Copies(Refusing):
    """``w.weight`` loaded by a plain copy (its landing map records)."""

    def __init__(self) -> None:
        super().__init__("plain")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _, t in weights:
            self.w.weight.data.copy_(t)


SPEC = ModelSpec({"w.weight": TensorSpec((4, 4), "float32")})


def core_for(model: Any, spec: ModelSpec | None = SPEC) -> _ReceiverCore:
    """A worker core on (fake) CUDA over ``model``, joining through the registry's connect."""
    return _ReceiverCore(
        backend="weightwire_ipc",
        device=torch.device("cuda", 0),
        target=lambda: (model, None),
        connect=connect,
        info_type=IPCInitInfo,
        spec=lambda: spec,
    )


def session(
    monkeypatch: pytest.MonkeyPatch, model: Any, asked: str, *, spec: ModelSpec | None = SPEC
) -> tuple[str, Any]:
    """One worker core joins a real rendezvous that asked for ``asked``: the session's mode
    and the worker's link."""
    rdv = pull_rendezvous(monkeypatch, asked)
    joined: dict[str, Any] = {}

    def trainer() -> None:
        comm = rdv.join(timeout=10)
        comm.warmup(timeout=10)
        joined["comm"] = comm

    thread = threading.Thread(target=trainer)
    thread.start()
    core = core_for(model, spec)
    try:
        core.init(IPCInitInfo.from_dict(rdv.payload))
    finally:
        thread.join(15)
    comm = joined["comm"]
    link = core._link
    comm.close()
    core.shutdown()
    return comm.mode, link


def test_a_loader_that_computes_makes_the_default_session_pull_and_one_line_says_why(
    cp: Any,  # noqa: F811  (the fake CUDA fixture)
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert TrainerInitInfo(backend="weightwire_ipc").ipc_mode == "auto"
    with caplog.at_level(logging.INFO, logger=TRAINER_LOG):
        mode, link = session(monkeypatch, Refusing("computes"), "auto")
    assert mode == "pull" and isinstance(link, IPCPullLink)
    assert not isinstance(link, IPCWriteThroughLink)
    (line,) = [r for r in caplog.records if "write-through" in r.getMessage()]
    assert line.levelno == logging.WARNING and line.getMessage() == (
        "weightwire_ipc: mode pull: ipc_mode='auto' pulls, not write-through: IPC worker rank 1 "
        f"cannot take it: {COMPUTES}"
    )


def test_a_plain_model_is_written_through_by_default(
    cp: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger=TRAINER_LOG):
        mode, link = session(monkeypatch, Copies(), "auto")
    assert mode == "write_through" and isinstance(link, IPCWriteThroughLink)
    assert not caplog.records  # the mode asked for was found: nothing to say


def test_a_model_that_runs_rounds_between_its_own_hooks_pulls(
    cp: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    host = HFModelHost.__new__(HFModelHost)  # only its type is read at the join
    with caplog.at_level(logging.WARNING, logger=TRAINER_LOG):
        mode, _ = session(monkeypatch, host, "auto", spec=None)
    assert mode == "pull"
    assert "cannot take it: HFModelHost applies every round between its own hooks" in caplog.text


@pytest.mark.parametrize(
    ("model", "asked", "want", "link"),
    [
        # asked explicitly: kept; a worker that cannot takes each round through its receive
        # buffers (its landing table's refusal), as before the default changed
        (Refusing("computes"), "write_through", "write_through", IPCWriteThroughLink),
        (Copies(), "pull", "pull", IPCPullLink),
    ],
)
def test_a_mode_asked_for_is_the_one_used(
    cp: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    model: Any,
    asked: str,
    want: str,
    link: type,
) -> None:
    with caplog.at_level(logging.WARNING, logger=TRAINER_LOG):
        mode, got = session(monkeypatch, model, asked)
    assert mode == want and type(got) is link and not caplog.records


def test_the_join_check_names_why_and_runs_the_loader_only_with_a_spec() -> None:
    assert join_landing(Copies(), SPEC).refused is None
    assert join_landing(Copies(), SPEC).map is not None
    assert join_landing(Refusing("computes"), SPEC).refused == COMPUTES
    # no spec: the loader cannot be run here (the tensors are unknown): decided per round
    assert join_landing(Refusing("computes"), None).refused is None


def test_the_first_round_takes_the_map_the_join_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    from weightwire.shared.meta import ParamMeta
    from weightwire.torch_side.worker import core as worker_core

    recorded: list[list[ParamMeta]] = []
    fresh = worker_core.record_landing
    monkeypatch.setattr(
        worker_core,
        "record_landing",
        lambda m, metas: recorded.append(list(metas)) or fresh(m, metas),
    )
    model = Copies()
    core = core_for(model)
    metas = [ParamMeta("w.weight", "float32", (4, 4))]
    joined = core._join_landing()
    assert joined.map is not None
    assert core._round_landing(model, metas) is joined and not recorded  # no second recording
    again = core._round_landing(model, metas)  # used once: the link keeps its table after
    assert again is not joined and recorded == [metas]
    joined = core._join_landing()
    other = [ParamMeta("w.weight", "bfloat16", (4, 4))]  # other tensors: recorded for them
    assert core._round_landing(model, other) is not joined and recorded[-1] == other


def test_a_worker_whose_connect_takes_no_landing_is_not_asked() -> None:
    from weightwire.backends.ipc.through.worker import connect_ipc
    from weightwire.backends.tcp.worker import connect_tcp
    from weightwire.backends.worker_base import takes_landing

    assert takes_landing(connect_ipc) and takes_landing(connect)
    assert not takes_landing(connect_tcp)


# -- the rule, and a delta session -------------------------------------------------------------

ALL = ["write_through", "pull", "push"]


@pytest.mark.parametrize(
    ("asked", "cannot", "mode", "why"),
    [
        ("auto", [], "write_through", None),
        ("auto", [("w1", "lm_head is quantized")], "pull", "w1 cannot take it: lm_head is"),
        ("write_through", [("w1", "lm_head is quantized")], "write_through", None),
        ("pull", [("w1", "lm_head is quantized")], "pull", None),
        ("push", [], "push", None),
    ],
)
def test_auto_pulls_where_a_worker_cannot_take_write_through(
    asked: str, cannot: list[tuple[str, str]], mode: str, why: str | None
) -> None:
    got, reason = choose_mode(asked, True, [ALL, ALL], cannot=cannot)
    assert got == mode
    assert (reason is None) == (why is None) and (why is None or why in str(reason))


def test_a_delta_session_pulls_under_auto_and_refuses_write_through_asked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    TrainerInitInfo(backend="weightwire_ipc", delta="auto")  # the default mode: accepted
    with pytest.raises(ConfigError, match="ipc_mode='write_through': delta rounds over weightw"):
        TrainerInitInfo(backend="weightwire_ipc", delta="auto", ipc_mode="write_through")
    with caplog.at_level(logging.INFO, logger=TRAINER_LOG):
        assert session_mode("auto", "auto") == "pull"
        assert session_mode("auto", "off") == "auto"
        assert session_mode("write_through", "off") == "write_through"
    (line,) = caplog.records
    assert "ipc_mode='auto' with delta='auto': rounds take the pull path" in line.getMessage()
