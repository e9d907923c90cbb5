"""Fault cases against a real vLLM (the tiny Llama): every round ends in state (a) or (b).

(a) every tensor loaded, greedy == Hugging Face on the new weights, the new version;
(b) the round refused or dropped: greedy == Hugging Face on the *previous* weights
(ids and logprobs), the weight checker's checksums unchanged, the previous version.
Each case is followed by a fresh trainer's successful round (state (a)), with no
manual finish. All cases share one vLLM; the module ends with the checkpoint restored.
A round applied in place that fails midway (state (c), the round guard) is
``test_round_in_place_faults.py``'s.
"""

from __future__ import annotations

import http.client
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import torch

from tests.interop.helpers import PROMPTS, assert_same_greedy
from tests.interop.models import hf_model, jax_params, load_into_hf, perturbed
from tests.interop.round_harness import (
    PACKED_16K,
    Served,
    dying_trainer,
    jax_engine,
    serve_tiny_llama,
    trainer_info,
)
from weightwire.control.client import HTTPWeightSyncClient
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.jax_side.source import PytreeSource
from weightwire.shared.errors import WeightSyncError
from weightwire.shared.served import ServedModelMismatch
from weightwire.torch_side.sender.engine import TorchTrainerEngine
from weightwire.torch_side.sender.source import ModuleSource
from weightwire.trainer.config import TrainerInitInfo
from weightwire.trainer.engine import EngineBroken

pytestmark = [pytest.mark.interop, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def served(launcher, model_dirs, tmp_path_factory) -> Iterator[Served]:
    yield from serve_tiny_llama(launcher, model_dirs, tmp_path_factory)


# ---------------------------------------------------------------- trainer death
@pytest.mark.parametrize("phase", ["after_start", "mid_update", "before_finish"])
def test_trainer_sigkilled_mid_round_leaves_previous_weights(served: Served, phase: str) -> None:
    before = served.checksums()
    with dying_trainer(served.server.url, served.server.model_dir, phase, "7") as child:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    # State (b): serving goes on with the previous weights, though the round never ended.
    served.assert_state_b(f"trainer killed {phase}", before)
    served.fresh_round(f"after a trainer killed {phase}")


# ---------------------------------------------------------------- bad update info
def _bad_source(kind: str, hf: torch.nn.Module) -> torch.nn.Module:
    bad = hf_model(hf.name_or_path)
    bad.load_state_dict(hf.state_dict())
    layer = bad.model.layers[0]
    with torch.no_grad():
        if kind == "wrong_shape":  # transposed: metadata and bytes consistent, shape wrong
            layer.self_attn.k_proj.weight = torch.nn.Parameter(
                layer.self_attn.k_proj.weight.t().contiguous()
            )
        elif kind == "wrong_dtype":  # a float32 norm sent as bfloat16
            bad.model.norm.weight = torch.nn.Parameter(bad.model.norm.weight.to(torch.bfloat16))
        elif kind == "unknown_name":
            bad.model.register_parameter("extra_scale", torch.nn.Parameter(torch.ones(4)))
        elif kind == "missing_tensor":
            del layer.mlp.up_proj._parameters["weight"]
    return bad


BAD = {
    "wrong_shape": (
        "'model.layers.0.self_attn.k_proj.weight' has shape [64, 32], the model's is [32, 64]"
    ),
    "wrong_dtype": (
        "'model.norm.weight' is bfloat16, the model holds it as float32 (no silent cast)"
    ),
    "unknown_name": "'model.extra_scale' is not a tensor of the model",
    "missing_tensor": (
        "layer 'model.layers.0' is incomplete: missing 'model.layers.0.mlp.up_proj.weight'"
    ),
}


# The same sources, refused by the trainer: the workers told it what they serve at init
# (the plugin's worker method over /collective_rpc), so no call of the round was made.
UNFIT = {
    "wrong_shape": (
        "model.layers.0.self_attn.k_proj.weight [64, 32] (served: [32, 64])",
        "shape differs",
    ),
    "wrong_dtype": ("[model.norm.weight (bfloat16)]", "cast the source to float32"),
    "unknown_name": ("1 tensor(s) [model.extra_scale] unknown to the served model",),
    "missing_tensor": (
        "1 tensor(s) [model.layers.0.mlp.up_proj.weight] of the served model missing",
        "TrainerInitInfo(partial=True)",
    ),
}


class Untold(HTTPWeightSyncClient):
    """A trainer that learned nothing of the served model: the workers' own checks refuse."""

    def workers_served_model(self) -> None:
        return None


@pytest.mark.parametrize("where", ["trainer", "worker"])
@pytest.mark.parametrize("kind", list(BAD))
def test_bad_update_info_is_refused_before_any_byte(served: Served, kind: str, where: str) -> None:
    before = served.checksums()
    source = ModuleSource(_bad_source(kind, served.hf))
    cls = HTTPWeightSyncClient if where == "trainer" else Untold
    # The workers' own checks: the trainer learns nothing of the served model, neither its
    # spec nor (sliced="off") the wants whose boxes would already show the served shapes.
    info = trainer_info() if where == "trainer" else trainer_info(sliced="off")
    with cls(served.server.url, timeout=120) as client:
        engine = TorchTrainerEngine.trainer_init(info, client=client, source=source)
        try:
            with pytest.raises(Exception) as err:
                engine.send_weights(weight_version=f"bad-{kind}")
            if where == "trainer":
                assert isinstance(err.value, ServedModelMismatch), repr(err.value)
                for words in UNFIT[kind]:
                    assert words in str(err.value), str(err.value)
            else:
                assert BAD[kind] in str(err.value), str(err.value)
                assert "refused before any byte was received" in str(err.value)
        finally:
            try:
                engine.shutdown()
            except WeightSyncError as exc:
                # Seen once under load: the client reused a keep-alive connection that
                # uvicorn had just closed (its 5 s idle timeout) and got a reset; the
                # server never saw the call. Any other shutdown error fails the case.
                if "(no response)" not in str(exc):
                    raise
    served.assert_state_b(f"refused {kind}", before)
    served.fresh_round(f"after a refused {kind}")


# ---------------------------------------------------------------- session ownership
def test_second_trainer_between_rounds_displaces_the_first(served: Served) -> None:
    with (
        HTTPWeightSyncClient(served.server.url, timeout=120) as ca,
        HTTPWeightSyncClient(served.server.url, timeout=120) as cb,
    ):
        a, _ = jax_engine(served, 201, ca)
        a.send_weights(weight_version="A-1")
        b, b_source = jax_engine(served, 202, cb)  # takes the session over between rounds
        try:
            before = served.checksums()
            with pytest.raises(
                EngineBroken, match="another trainer initialized and took the session over"
            ):
                a.send_weights(weight_version="A-2")  # fails fast: nothing posted, nothing sent
            a.shutdown()  # must not tear down B's session
            assert served.server.weight_version() == "A-1"
            assert served.checksums() == before
            b.send_weights(weight_version="B-1")
            load_into_hf(served.hf, b_source)
            served.version = "B-1"
            assert_same_greedy(served.server, served.hf, "B's round after A was displaced")
        finally:
            b.shutdown()
    served.fresh_round("after the displacement")


@pytest.mark.parametrize("when", ["after_start", "before_finish"])
def test_second_trainer_mid_round_is_refused(served: Served, when: str) -> None:
    refusals: list[str] = []
    with (
        HTTPWeightSyncClient(served.server.url, timeout=120) as ca,
        HTTPWeightSyncClient(served.server.url, timeout=120) as cb,
    ):
        params_b, naming = jax_params(served.server.model_dir)
        intruder_source = PytreeSource(lambda: params_b, naming)

        def intrude() -> None:
            try:
                intruder = JAXTrainerEngine.trainer_init(
                    trainer_info(), client=cb, source=intruder_source
                )
            except Exception as exc:  # the refusal is what this test wants
                refusals.append(str(exc))
            else:
                intruder.shutdown()
                refusals.append("ACCEPTED")

        a, a_source = jax_engine(served, 301, ca)
        hook: Callable[..., None]
        if when == "after_start":
            real_start = ca.start_weight_update

            def hook() -> None:
                real_start()
                intrude()

            ca.start_weight_update = hook  # type: ignore[method-assign]
        else:
            real_finish = ca.finish_weight_update

            def hook(*args: object, **kwargs: object) -> None:
                intrude()
                real_finish(*args, **kwargs)

            ca.finish_weight_update = hook  # type: ignore[method-assign]
        try:
            # after_start: A's bytes wait while B's init is refused; A's round then completes.
            a.send_weights(weight_version=f"A-{when}")
        finally:
            a.shutdown()
    assert len(refusals) == 1 and "refused: a weight update of session" in refusals[0], refusals
    load_into_hf(served.hf, a_source)
    served.version = f"A-{when}"
    assert served.server.weight_version() == served.version
    assert_same_greedy(served.server, served.hf, f"A's round with an intruder {when}")
    served.fresh_round(f"after an intruder {when}")


# ---------------------------------------------------------------- live traffic
class _PostedDuring:
    """A completion posted while a round is open: written whole to the server's socket once the
    round's start was answered (before its update and finish are posted), its answer read on
    a thread. Whatever the pause mode, its life overlaps the round: held at the pause until
    the resume, or run beside the update."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.replies: list[tuple[int, Any]] = []
        self.readers: list[threading.Thread] = []

    def post(self) -> None:
        where = urlsplit(self.url)
        request = httpx.Request(
            "POST",
            f"{self.url}/v1/completions",
            json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0.0},
            headers={"connection": "close"},
        )
        head = "".join(f"{k}: {v}\r\n" for k, v in request.headers.items())
        sock = socket.create_connection((where.hostname, where.port), timeout=120)
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\n{head}\r\n".encode() + request.read())
        reader = threading.Thread(target=self._answer, args=(sock,), daemon=True)
        reader.start()
        self.readers.append(reader)

    def _answer(self, sock: socket.socket) -> None:
        with sock:
            reply = http.client.HTTPResponse(sock)
            reply.begin()
            self.replies.append((reply.status, reply.read()[:200]))


def test_live_completions_during_five_rounds_default_settings(served: Served) -> None:
    """Three clients post completions in a loop through five rounds, and one completion is
    posted while each round is open (``_PostedDuring``: the loops alone may fall between two
    rounds); every one is answered 200, and greedy equals Hugging Face after."""
    stop = threading.Event()
    done: list[int] = [0, 0, 0]
    errors: list[str] = []
    during = _PostedDuring(served.server.url)

    def client_loop(i: int) -> None:
        with httpx.Client(timeout=120) as http:
            while not stop.is_set():
                reply = http.post(
                    f"{served.server.url}/v1/completions",
                    json={"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 8, "temperature": 0.0},
                )
                if reply.status_code != 200:
                    errors.append(f"{reply.status_code}: {reply.text[:200]}")
                    return
                done[i] += 1

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    params0, naming = jax_params(served.server.model_dir)
    live = {"params": params0}
    source = PytreeSource(lambda: live["params"], naming)
    try:
        with HTTPWeightSyncClient(served.server.url, timeout=120) as client:
            real_start = client.start_weight_update

            def start_then_post() -> None:
                real_start()
                during.post()

            client.start_weight_update = start_then_post  # type: ignore[method-assign]
            # Default settings: no pause_mode given (the coordinator is changing the default
            # to "keep").
            engine = JAXTrainerEngine.trainer_init(
                TrainerInitInfo(backend="weightwire_tcp", packed_buffer_size_bytes=PACKED_16K),
                client=client,
                source=source,
            )
            try:
                for r in range(1, 6):
                    live["params"] = perturbed(params0, 400 + r)
                    engine.send_weights(weight_version=f"live-{r}")
                    assert served.server.weight_version() == f"live-{r}"
            finally:
                engine.shutdown()
    finally:
        stop.set()
        for t in threads + during.readers:
            t.join(timeout=150)
    assert not errors, errors[:3]
    assert all(n > 0 for n in done), done
    assert [status for status, _ in during.replies] == [200] * 5, during.replies
    load_into_hf(served.hf, source)
    served.version = "live-5"
    assert_same_greedy(served.server, served.hf, "after 5 rounds under live traffic")
    print(f"live completions during 5 rounds: {done} (total {sum(done)}), errors 0")
