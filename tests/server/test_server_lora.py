"""LoRA adapters on the reference server (``--enable-lora``), two replicas, one start.

The same semantics as vLLM with the plugin: the first round registers the adapter from
the trainer's PEFT directory, later rounds replace it in memory; completions naming the
adapter equal Hugging Face + PEFT on the trainer's adapter, the base model's stay the
same, a round that fails midway leaves the previous adapter serving, and what the server
cannot take is refused before any byte of a round.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from tests.interop.helpers import VLLMServer, assert_same_greedy
from tests.lora.adapters import (
    ALPHA,
    Breaking,
    base_model,
    into_peft,
    jax_adapter,
    peft_model,
    randomize_peft,
)
from weightwire.control.client import HTTPWeightSyncClient
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.jax_side.lora import lora_source
from weightwire.shared.errors import ConfigError, WeightSyncError, WeightwireError
from weightwire.shared.lora import LoRASpec, write_adapter_dir
from weightwire.shared.meta import ParamMeta
from weightwire.shared.source import WeightSource
from weightwire.torch_side.sender.engine import TorchTrainerEngine
from weightwire.torch_side.sender.lora import PeftAdapterSource, peft_alpha
from weightwire.trainer.config import TrainerInitInfo
from weightwire.trainer.lora import AdapterRefused, AdapterSync

pytestmark = pytest.mark.timeout(600)
MAX_RANK = 8
INFO = TrainerInitInfo(backend="weightwire_tcp", packed_buffer_size_bytes=8 << 10)


@pytest.fixture(scope="module")
def server(server_factory: Any, tiny_llama: str) -> VLLMServer:
    args = ["--model", tiny_llama, "--replicas", "2", "--enable-lora", "--check-finite"]
    proc = server_factory([*args, "--max-lora-rank", str(MAX_RANK)])
    return VLLMServer(proc.url, tiny_llama)


@pytest.fixture(scope="module")
def base_tokens(server: VLLMServer) -> list[list[int]]:
    return assert_same_greedy(server, base_model(server.model_dir), "base model")


@pytest.fixture
def client(server: VLLMServer) -> Iterator[HTTPWeightSyncClient]:
    c = HTTPWeightSyncClient(server.url, timeout=120)
    yield c
    c.close()


def _check(server: VLLMServer, ref: Any, base: list[list[int]], adapter: str, what: str) -> Any:
    tokens = assert_same_greedy(server, ref, what, served=adapter)
    assert server.greedy()[0] == base, f"{what}: the base model's completions changed"
    assert tokens != base, f"{what}: the adapter changed nothing"
    return tokens


def test_jax_adapter_rounds_match_peft_and_a_broken_round_changes_nothing(
    server: VLLMServer, base_tokens: list[list[int]], client: Any, tmp_path: Path
) -> None:
    ref = peft_model(server.model_dir)
    live = {"tree": jax_adapter(0)}
    source = lora_source(lambda: live["tree"], "jaxpol")
    engine = JAXTrainerEngine.trainer_init(INFO, client=client, source=source)
    sync = AdapterSync(engine, "jaxpol", alpha=ALPHA, adapter_dir=tmp_path / "jaxpol")
    previous: Any = None
    try:
        for r in (1, 2, 3):
            live["tree"] = jax_adapter(r)
            assert sync.send(weight_version=f"jax-{r}").chunks > 1
            into_peft(ref, source)
            tokens = _check(server, ref, base_tokens, "jaxpol", f"JAX adapter round {r}")
            assert tokens != previous
            previous = tokens
        # The adapter cannot change shape once registered: refused before any byte.
        live["tree"] = jax_adapter(4, rank=2)
        with pytest.raises(ConfigError, match="rank 2 differs from the registered rank 4"):
            sync.send()
    finally:
        engine.shutdown()
    live["tree"] = jax_adapter(99)
    broken = JAXTrainerEngine.trainer_init(
        INFO, client=client, source=Breaking(lora_source(lambda: live["tree"], "jaxpol"), 9)
    )
    try:
        with pytest.raises(Exception, match="mid-round"):
            broken.send_weights()
    finally:
        broken.shutdown()
    assert _check(server, ref, base_tokens, "jaxpol", "after a broken round") == previous


def test_peft_trainer_adapter_rounds(
    server: VLLMServer, base_tokens: list[list[int]], client: Any, tmp_path: Path
) -> None:
    trainer = peft_model(server.model_dir)
    engine = TorchTrainerEngine.trainer_init(
        INFO, client=client, source=PeftAdapterSource(trainer, "torchpol")
    )
    sync = AdapterSync(
        engine, "torchpol", alpha=peft_alpha(trainer), adapter_dir=tmp_path / "torchpol"
    )
    gen = torch.Generator().manual_seed(1)
    try:
        for r in (1, 2):
            randomize_peft(trainer, gen)
            sync.send()
            _check(server, trainer, base_tokens, "torchpol", f"PEFT adapter round {r}")
    finally:
        engine.shutdown()


def test_an_adapter_round_goes_in_one_request_where_its_data_path_hears_the_workers(
    server: VLLMServer, base_tokens: list[list[int]], tmp_path: Path
) -> None:
    """A paused adapter round over a data path that writes nothing before its workers' word
    (``tests.faults.one_request``, as ``weightwire_ipc`` written through) is one request
    (``routes.UPDATE_STARTS``): the adapter committed in it serves as PEFT does."""
    from tests.faults.one_request import ONE_REQUEST, hearing
    from tests.server.test_round_http_calls import Routes

    client = Routes(server.url, timeout=120)
    trainer = peft_model(server.model_dir)
    info = TrainerInitInfo(
        backend="weightwire_tcp", packed_buffer_size_bytes=8 << 10, pause_mode="abort"
    )
    engine = TorchTrainerEngine.trainer_init(
        info, client=client, source=PeftAdapterSource(trainer, "onepol")
    )
    wire = hearing(engine, server.url)
    sync = AdapterSync(engine, "onepol", alpha=peft_alpha(trainer), adapter_dir=tmp_path / "one")
    gen = torch.Generator().manual_seed(3)
    try:
        for r in (1, 2):
            randomize_peft(trainer, gen)
            client.sent.clear()
            sync.send()
            _check(server, trainer, base_tokens, "onepol", f"adapter round {r} in one request")
        # the second round: the adapter registered, replaced in memory by the one request
        assert client.sent == [ONE_REQUEST.format(pause="pause=abort", reset="true")], client.sent
        assert wire.rounds[-1] is True
    finally:
        engine.shutdown()
        client.close()


def test_verify_covers_adapter_rounds(server: VLLMServer, client: Any, tmp_path: Path) -> None:
    """``verify=True`` with adapter rounds: every replica's ``/weight_checker`` checksums
    list the adapter's matrices under the names its rounds send, so each round is proven
    byte for byte (was: the checksums covered the base model only, and every committed
    adapter round raised ``VerifyError``: "N of N tensors differ ... absent on the
    server")."""
    live = {"tree": jax_adapter(11)}
    source = lora_source(lambda: live["tree"], "verified")
    info = dataclasses.replace(INFO, verify=True)
    engine = JAXTrainerEngine.trainer_init(info, client=client, source=source)
    try:
        sync = AdapterSync(engine, "verified", alpha=ALPHA, adapter_dir=tmp_path / "verified")
        for r in (12, 13):
            live["tree"] = jax_adapter(r)
            metrics = sync.send(weight_version=f"verified-{r}")
            assert metrics.verify is not None and metrics.verify.mode == "digest"
            assert metrics.verify.checked == len(source.metadata())
        sums = httpx.post(
            f"{server.url}/weight_checker", json={"action": "checksum"}, timeout=60
        ).json()
        names = [m.name for m in source.metadata()]
        assert all(set(names) <= set(replica) for replica in sums["replica_checksums"])
        assert sums["consistent"], "the replicas hold different adapter bytes"
    finally:
        engine.shutdown()


def test_what_the_server_cannot_serve_is_refused_before_a_round(
    server: VLLMServer, client: Any, tmp_path: Path
) -> None:
    cases = [
        ("toobig", jax_adapter(5, rank=MAX_RANK * 2), f"greater than --max-lora-rank {MAX_RANK}"),
        ("badmod", jax_adapter(6), "act_fn is not a linear layer"),
    ]
    cases[1][1]["model"]["layers"][0]["mlp"]["act_fn"] = cases[1][1]["model"]["layers"][0]["mlp"][
        "up_proj"
    ]
    for name, tree, match in cases:
        engine = JAXTrainerEngine.trainer_init(INFO, client=client, source=lora_source(tree, name))
        try:
            sync = AdapterSync(engine, name, alpha=ALPHA, adapter_dir=tmp_path / name)
            with pytest.raises(AdapterRefused, match=match):
                sync.send()
            assert engine.session.rounds == 0
        finally:
            engine.shutdown()
    # A round for an adapter nobody registered: the workers refuse it before its bytes.
    engine = JAXTrainerEngine.trainer_init(
        INFO, client=client, source=lora_source(jax_adapter(7), "stranger")
    )
    try:
        with pytest.raises(WeightwireError, match="'stranger' is not registered"):
            engine.send_weights()
    finally:
        engine.shutdown()
    reply = httpx.post(
        f"{server.url}/v1/completions", json={"model": "stranger", "prompt": [1, 2]}, timeout=60
    )
    assert reply.status_code == 404, reply.text


def test_a_non_finite_adapter_round_is_refused_and_the_previous_adapter_serves(
    server: VLLMServer, client: Any, tmp_path: Path
) -> None:
    def send(tree: dict[str, Any]) -> None:
        # A refused finish ends the trainer's session on the server: one engine per round.
        engine = JAXTrainerEngine.trainer_init(
            INFO, client=client, source=lora_source(tree, "finpol")
        )
        try:
            AdapterSync(engine, "finpol", alpha=ALPHA, adapter_dir=tmp_path / "finpol").send()
        finally:
            engine.shutdown()

    send(jax_adapter(11))
    before = server.greedy(model="finpol")
    for bad in (float("nan"), float("inf")):
        tree = jax_adapter(12)
        q = tree["model"]["layers"][1]["self_attn"]["q_proj"]
        q["lora_a"] = q["lora_a"].at[3, 1].set(bad)
        with pytest.raises(WeightSyncError) as refused:
            send(tree)
        assert refused.value.status == 400, refused.value
        message = str(refused.value)
        assert "'base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight'" in message
        assert "NaN or infinite values (--check-finite)" in message
        assert "nothing was committed" in message
        assert server.greedy(model="finpol") == before
    send(jax_adapter(13))  # a finite round after the refused ones commits
    assert server.greedy(model="finpol")[0] != before[0]


def test_an_adapter_config_with_unusable_numbers_is_refused_at_load(
    server: VLLMServer, tmp_path: Path
) -> None:
    source = lora_source(jax_adapter(21), "cfgpol")
    spec = LoRASpec.from_metas(source.metadata())
    good = write_adapter_dir(
        tmp_path / "good", spec, {n: np.asarray(t) for n, t in source}, alpha=ALPHA
    )
    config = json.loads((good / "adapter_config.json").read_text())
    cases = [
        ("lora_alpha", float("nan"), "lora_alpha must be a finite number in (0, 65536], got nan"),
        ("lora_alpha", 1e308, "lora_alpha must be a finite number in (0, 65536], got 1e+308"),
        ("lora_alpha", -8.0, "lora_alpha must be a finite number in (0, 65536], got -8.0"),
        ("lora_alpha", "8", "lora_alpha must be a number, got '8'"),
        ("r", 4.5, "r is 4.5 but the matrices have rank 4"),
        ("lora_dropout", float("inf"), "lora_dropout must be a number in [0, 1), got inf"),
    ]
    for i, (field, value, message) in enumerate(cases):
        bad = tmp_path / f"bad{i}"
        bad.mkdir()
        (bad / "adapter_model.safetensors").write_bytes(
            (good / "adapter_model.safetensors").read_bytes()
        )
        (bad / "adapter_config.json").write_text(json.dumps({**config, field: value}))
        reply = httpx.post(
            f"{server.url}/v1/load_lora_adapter",
            json={"lora_name": f"cfg{i}", "lora_path": str(bad)},
            timeout=60,
        )
        assert reply.status_code == 400, (field, value, reply.text)
        assert message in reply.json()["error"]["message"], (field, value, reply.text)
        assert f"{bad}: adapter_config.json: {field}" in reply.json()["error"]["message"]
        served = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": f"cfg{i}", "prompt": [1, 2], "max_tokens": 2},
            timeout=60,
        )
        assert served.status_code == 404, served.text
    for body in ([], None, "cfg"):  # a JSON body that is no object: a 400, not a 500
        reply = httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, timeout=60)
        assert reply.status_code == 400, (body, reply.text)
        assert "must be a JSON object" in reply.json()["error"]["message"], reply.text


class _AtTensor(WeightSource):
    """The inner source's tensors; once ``action`` is set, it runs (once) before tensor
    ``at`` of the next pass: the round is open on the server and its update (it names the
    adapter) in flight, the first chunks sent."""

    def __init__(self, inner: WeightSource, at: int) -> None:
        self.inner, self.at = inner, at
        self.action: Any = None

    def metadata(self) -> list[ParamMeta]:
        return self.inner.metadata()

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for i, pair in enumerate(self.inner):
            if i == self.at and self.action is not None:
                action, self.action = self.action, None
                action()
            yield pair


def _unload(server: VLLMServer, body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/unload_lora_adapter", json=body, timeout=60)


def _served(server: VLLMServer) -> set[str]:
    models = httpx.get(f"{server.url}/v1/models", timeout=60).json()["data"]
    return {m["id"] for m in models}


def _wait_busy(server: VLLMServer, op: str) -> None:
    """Until the server runs weight operation ``op`` (its update is in flight), bounded."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = httpx.get(f"{server.url}/weight_info", timeout=10).json()["session"]
        if state["busy"] == op:
            return
        time.sleep(0.01)
    raise AssertionError(f"the server never ran {op}")


def test_unload_drops_an_adapter_a_round_replaced_or_the_route_loaded(
    server: VLLMServer, base_tokens: list[list[int]], client: Any, tmp_path: Path
) -> None:
    """``POST /v1/unload_lora_adapter`` (vLLM's body, ``lora_name``): refused 409 naming the
    adapter while the open round writes it (its finish swaps it in; the round then commits),
    then 200 for an adapter ``AdapterSync`` registered and a round replaced, and for one the
    load route loaded: neither is listed or served (404) after, every replica's checksums
    drop its matrices and base completions are unchanged; 404 naming an unknown adapter,
    400 without a name. ``AdapterSync.register`` registers an unloaded adapter again."""
    live = {"tree": jax_adapter(31)}
    refusals: list[httpx.Response] = []

    def unload_mid_round() -> None:
        _wait_busy(server, "update_weights")
        refusals.append(_unload(server, {"lora_name": "unpol"}))

    # 28 tensors of 1-2 KiB in 8 KiB chunks: tensor 20 is read after the update went out
    source = _AtTensor(lora_source(lambda: live["tree"], "unpol"), 20)
    engine = JAXTrainerEngine.trainer_init(INFO, client=client, source=source)
    try:
        sync = AdapterSync(engine, "unpol", alpha=ALPHA, adapter_dir=tmp_path / "unpol")
        sync.send()  # registered from its directory, then replaced by the round
        live["tree"] = jax_adapter(32)
        source.action = unload_mid_round
        sync.send(weight_version="unpol-2")  # the refusal changed nothing of this round
        assert [r.status_code for r in refusals] == [409], [r.text for r in refusals]
        message = refusals[0].json()["error"]["message"]
        assert "adapter 'unpol' not unloaded" in message and "writes it" in message, message
        replaced = server.greedy(model="unpol")[0]
        assert replaced != base_tokens

        other = lora_source(jax_adapter(33), "loaded")
        directory = write_adapter_dir(
            tmp_path / "loaded",
            LoRASpec.from_metas(other.metadata()),
            {n: np.asarray(t) for n, t in other},
            alpha=ALPHA,
        )
        reply = httpx.post(
            f"{server.url}/v1/load_lora_adapter",
            json={"lora_name": "loaded", "lora_path": str(directory)},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert {"unpol", "loaded"} <= _served(server)

        for name in ("unpol", "loaded"):
            reply = _unload(server, {"lora_name": name})
            assert reply.status_code == 200, reply.text
            assert f"LoRA adapter '{name}' removed" in reply.text
            assert name not in _served(server)
            gone = httpx.post(
                f"{server.url}/v1/completions",
                json={"model": name, "prompt": [1, 2], "max_tokens": 2},
                timeout=60,
            )
            assert gone.status_code == 404, gone.text
        sums = httpx.post(
            f"{server.url}/weight_checker", json={"action": "checksum"}, timeout=60
        ).json()["replica_checksums"]
        assert len(sums) == 2
        assert not [k for replica in sums for k in replica if ".unpol." in k or ".loaded." in k]
        assert server.greedy()[0] == base_tokens

        unknown = _unload(server, {"lora_name": "unpol"})
        assert unknown.status_code == 404, unknown.text
        assert "'unpol' cannot be found" in unknown.json()["error"]["message"]
        for body in ({}, {"lora_name": ""}, None):
            nameless = _unload(server, body)
            assert nameless.status_code == 400, nameless.text
            assert "'lora_name' needs to be provided" in nameless.json()["error"]["message"]

        assert sync.register()  # not listed any more: loaded again from its directory
        sync.send(weight_version="unpol-3")
        assert server.greedy(model="unpol")[0] == replaced  # the same tensors as round 2
    finally:
        engine.shutdown()


def test_a_send_after_an_external_unload_says_so_and_the_next_registers_again(
    server: VLLMServer, client: Any, tmp_path: Path
) -> None:
    """``/v1/unload_lora_adapter`` from outside after ``AdapterSync`` registered the adapter:
    its next ``send`` fails naming what happened and the fix (``AdapterUnloaded``: the
    adapter was unloaded from the server; it registers again) and commits nothing; the
    ``send`` after it registers the adapter again by itself (was: the workers' "not
    registered here" only, and every later ``send`` failed the same way: the registration
    was cached)."""
    from weightwire.trainer.lora import AdapterUnloaded

    live = {"tree": jax_adapter(41)}
    source = lora_source(lambda: live["tree"], "extpol")
    engine = JAXTrainerEngine.trainer_init(INFO, client=client, source=source)
    try:
        sync = AdapterSync(engine, "extpol", alpha=ALPHA, adapter_dir=tmp_path / "extpol")
        sync.send(weight_version="ext-1")
        first = server.greedy(model="extpol")[0]
        assert _unload(server, {"lora_name": "extpol"}).status_code == 200
        live["tree"] = jax_adapter(42)
        with pytest.raises(AdapterUnloaded) as got:
            sync.send(weight_version="ext-2")
        text = str(got.value)
        assert "adapter 'extpol' is not loaded on " in text, text
        assert "/v1/unload_lora_adapter" in text and "call register()" in text, text
        assert got.value.status == 400 and got.value.route == "update_weights"
        assert "extpol" not in _served(server)
        if engine.session.broken is not None:  # the round failed after its start
            engine.shutdown()
            engine = JAXTrainerEngine.trainer_init(INFO, client=client, source=source)
            sync.engine = engine
        sync.send(weight_version="ext-3")  # registered again, then replaced by the round
        assert "extpol" in _served(server)
        assert server.greedy(model="extpol")[0] != first
    finally:
        engine.shutdown()


class _NoLoRA(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self._reply(b'{"object": "list", "data": []}', 200)

    def do_POST(self) -> None:
        self._reply(b'{"detail": "Not Found"}', 404)

    def _reply(self, body: bytes, status: int) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_a_server_without_lora_is_named_as_such(tmp_path: Path) -> None:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoLoRA)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    source = lora_source(jax_adapter(1), "pol")
    engine: Any = SimpleNamespace(info=INFO, source=source, client=SimpleNamespace(base_urls=["x"]))
    engine.host_bytes = lambda t: np.asarray(t).reshape(-1).view(np.uint8)
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    sync = AdapterSync(engine, "pol", alpha=ALPHA, adapter_dir=tmp_path / "pol", base_urls=[url])
    try:
        with pytest.raises(AdapterRefused, match="serves no adapters.*--enable-lora"):
            sync.register()
    finally:
        httpd.shutdown()
