"""``verify=True`` against a stock vLLM's ``/weight_checker`` (keys ``dp:pp:pcp:tp:<vLLM param>``
over fused shards), draft rounds, ``abort_requests`` and the version gates of an engine."""

from __future__ import annotations

import hashlib
import logging

import httpx
import numpy as np
import pytest

from tests.trainer.commit_order import canonical
from tests.trainer.fakes import FAKE, FAST, DictSource, FakeComm, FakeServer
from weightwire.jax_side.dtypes import describe
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.shared.framing import plan_packed, unpack_host
from weightwire.shared.update_info import UpdateInfo
from weightwire.trainer import TrainerInitInfo, VerifyError
from weightwire.trainer.verify import vllm_param_name

TP = 2


class FakeVLLM(FakeServer):
    """``/weight_checker`` like vLLM: it loads what the trainer broadcast (fusing q/k/v and
    gate/up, slicing rows over ``TP`` shards) and checksums each shard under vLLM's keys."""

    def __init__(self, params: dict[str, np.ndarray], version: str = "0.33.0") -> None:
        super().__init__(version=version)
        self.parts: dict[str, dict[str, np.ndarray]] = {}  # vLLM param -> HF name -> array
        for name, arr in params.items():
            self.parts.setdefault(vllm_param_name(name), {})[name] = arr.copy()
        self.drop: set[str] = set()  # HF names whose load this fake "loses"
        self.corrupt: str | None = None
        self.empty: set[str] = set()  # vLLM params reported as empty bytes (CPU repacking)
        self.draft = True  # /server_info shows a speculative_config
        self.hooks["finish_weight_update"] = self._load

    def _load(self, body: object) -> None:
        infos = [UpdateInfo.from_dict(b["update_info"]) for b in self.bodies("update_weights")]
        metas = next(
            i for i in reversed(infos) if i.names
        ).metas()  # empty lists: the previous round's (0.33)
        chunks = plan_packed(metas, 1 << 20)
        for chunk, raw in zip(chunks, FAKE.comm.broadcasts[-len(chunks) :], strict=True):
            for name, arr in unpack_host(np.frombuffer(raw, np.uint8), metas, chunk):
                if name not in self.drop:
                    self.parts[vllm_param_name(name)][name] = arr
        if self.corrupt:
            part = next(iter(self.parts[self.corrupt]))
            self.parts[self.corrupt][part] = self.parts[self.corrupt][part] + 1

    def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/server_info":
            self.calls.append(("server_info", None))
            spec = {"method": "eagle", "num_speculative_tokens": 2} if self.draft else None
            return httpx.Response(200, json={"vllm_config": {"speculative_config": spec}})
        if request.url.path != "/weight_checker" or "weight_checker" in self.fail:
            return super().handler(request)
        self.calls.append(("weight_checker", None))
        out = {}
        for param, parts in self.parts.items():
            fused = np.concatenate([a.reshape(-1) for _, a in sorted(parts.items())])
            for tp, shard in enumerate(np.array_split(fused, TP)):
                data = b"" if param in self.empty else shard.tobytes()
                out[f"dp0:pp0:pcp0:tp{tp}:{param}"] = hashlib.sha256(data).hexdigest()
        return httpx.Response(200, json={"checksums": out})


def weights(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    names = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.norm.weight",
    ]
    return {n: rng.standard_normal(8).astype(np.float32) for n in names}


def engine_for(server: FakeServer, w: dict, **info: object) -> JAXTrainerEngine:
    FAKE.comm = FakeComm()
    kwargs = {
        "backend": "fake_host",
        "timeouts": FAST,
        "verify": True,
        "packed_buffer_size_bytes": 1 << 20,
        **info,
    }
    return JAXTrainerEngine.trainer_init(
        TrainerInitInfo(**kwargs),
        client=server.client(),  # type: ignore[arg-type]
        source=DictSource(w, describe),
    )


def test_vllm_diff_mode_baseline_then_change_detection() -> None:
    w = weights(0)
    server = FakeVLLM(weights(99))
    server.parts["model.layers.1.mlp.down_proj.weight"] = {
        "model.layers.1.mlp.down_proj.weight": np.zeros(4, np.float32)
    }
    engine = engine_for(server, w)
    m1 = engine.send_weights()
    assert m1.verify.mode == "vllm-diff" and "baseline round" in m1.verify.proves
    w["model.layers.0.self_attn.k_proj.weight"] += 1  # only the fused qkv parameter must change
    m2 = engine.send_weights()
    assert m2.verify.proves.startswith(
        "no parameter outside the sent set changed; every parameter fed by changed"
    )
    assert m2.verify.unmapped == [] and m2.verify.checked == 4
    # A lost load: k_proj's new bytes never reached the fused parameter.
    w["model.layers.0.self_attn.k_proj.weight"] += 1
    server.drop = {"model.layers.0.self_attn.k_proj.weight"}
    with pytest.raises(VerifyError) as info:
        engine.send_weights()
    assert info.value.committed and info.value.weight_version == "3"
    msg = str(info.value)
    assert msg.startswith(
        "round '3' was committed (every worker loaded it and finish_weight_update returned), but"
    )
    assert (
        "fed by tensors whose bytes changed since the last round did not change on any shard: "
        "model.layers.0.self_attn.qkv_proj.weight" in msg
    )


def test_vllm_diff_flags_a_parameter_the_round_did_not_send() -> None:
    server = FakeVLLM(weights(99))
    server.parts["model.layers.1.mlp.down_proj.weight"] = {
        "model.layers.1.mlp.down_proj.weight": np.zeros(4, np.float32)
    }
    server.corrupt = "model.layers.1.mlp.down_proj.weight"
    engine = engine_for(server, weights(0))
    with pytest.raises(
        VerifyError,
        match=r"server 0: 2 parameters the round did not send changed: "
        r"dp0:pp0:pcp0:tp0:model\.layers\.1\.mlp\.down_proj\.weight, dp0:pp0:pcp0:tp1:",
    ):
        engine.send_weights()
    assert server.routes().count("finish_weight_update") == 1


def test_vllm_diff_flags_a_change_where_the_same_bytes_were_sent() -> None:
    w = weights(0)
    server = FakeVLLM(weights(99))
    engine = engine_for(server, w)
    engine.send_weights()
    server.corrupt = "model.norm.weight"
    with pytest.raises(
        VerifyError,
        match=r"changed although every tensor feeding them was sent with the same bytes "
        r"as last round: dp0:pp0:pcp0:tp0:model\.norm\.weight",
    ):
        engine.send_weights()


def test_empty_checksums_are_unobservable_not_failures() -> None:
    w = weights(0)
    server = FakeVLLM(weights(99))
    server.empty = {"model.layers.0.mlp.down_proj.weight"}
    engine = engine_for(server, w)
    engine.send_weights()
    w["model.layers.0.mlp.down_proj.weight"] += 1
    report = engine.send_weights().verify
    assert report.unobservable == ["model.layers.0.mlp.down_proj.weight"]


def test_checker_404_after_commit_says_the_round_landed() -> None:
    server = FakeVLLM(weights(99))
    engine = engine_for(server, weights(0))

    def gone(_: object) -> None:
        server.fail["weight_checker"] = (404, "Not Found")

    server.hooks["finish_weight_update"] = gone
    with pytest.raises(
        VerifyError,
        match=r"round '1' was committed .* weight_checker failed after the round: "
        r"WeightSyncError: .*404",
    ) as info:
        engine.send_weights()
    assert info.value.committed
    assert server.bodies("finish_weight_update") == [{"weight_version": "1"}]


@pytest.mark.parametrize("version", ["0.30.0", "0.31.1", "0.32.0rc1"])
def test_verify_on_servers_without_the_checker_is_refused_before_init(version: str) -> None:
    server = FakeServer(version=version)
    with pytest.raises(
        ValueError, match=rf"server version {version} lacks weight_checker_route .*verify=True"
    ):
        engine_for(server, weights(0))
    assert "init_weight_transfer_engine" not in server.routes()


def test_draft_round_starts_with_the_draft_route_and_checks_the_target_is_untouched() -> None:
    server = FakeVLLM(weights(99))
    server.hooks.pop("finish_weight_update")  # the draft model is not in vLLM's checker
    engine = engine_for(server, weights(0), pause_mode="keep")
    report = engine.send_weights(draft=True).verify
    assert canonical(server.routes())[-10:] == [
        "server_info",
        "weight_checker",
        "pause",
        "start_draft_weight_update",
        "update_weights",
        "finish_weight_update",
        "reset_prefix_cache",
        "reset_encoder_cache",
        "resume",
        "weight_checker",
    ]
    assert report.mode == "draft" and "target model did not change" in report.proves
    engine.send_weights(
        draft=True
    )  # the draft's metadata cache is its own: full metadata went first
    first, second = server.bodies("update_weights")
    assert first["update_info"]["names"] and second["update_info"]["names"] == []
    engine.send_weights()  # the target has not seen this metadata yet: full again
    assert server.bodies("update_weights")[2]["update_info"]["names"]


def test_draft_round_without_a_draft_model_is_refused_before_any_call() -> None:
    # vLLM 0.32 answers /start_draft_weight_update without a draft model by killing its engine core.
    server = FakeVLLM(weights(99))
    server.draft = False
    engine = engine_for(server, weights(0), pause_mode="keep")
    before = len(server.calls)
    with pytest.raises(
        ValueError, match=r"server\(s\) 0 show no speculative draft model .*kill vLLM's engine core"
    ):
        engine.send_weights(draft=True)
    assert server.routes()[before:] == [
        "server_info"
    ]  # asked, then nothing: no pause, no start, no byte
    assert not FAKE.comm.broadcasts
    engine.send_weights()  # the engine is still usable for the target


def test_draft_round_that_changes_the_target_fails_verify() -> None:
    server = FakeVLLM(weights(99))
    engine = engine_for(server, weights(0))  # the hook loads into the target: wrong model
    with pytest.raises(VerifyError, match="round '1' was committed.*did not send changed"):
        engine.send_weights(draft=True)


def test_abort_requests_reaches_every_server() -> None:
    server = FakeServer()
    engine = engine_for(server, weights(0), verify=False)
    engine.abort_requests()
    engine.abort_requests(["a", "b"])
    assert server.bodies("abort_requests") == [{}, {"request_ids": ["a", "b"]}]


# --- gates ------------------------------------------------------------------------------


def test_stated_server_version_must_match_what_the_server_reports() -> None:
    server = FakeServer(version="0.32.0")
    with pytest.raises(
        ValueError, match=r"server_version is '0\.33\.0' but the server reports '0\.32\.0'"
    ):
        engine_for(server, weights(0), verify=False, server_version="0.33.0")
    assert "init_weight_transfer_engine" not in server.routes()
    engine_for(
        FakeServer(version="0.33.0"), weights(0), verify=False, server_version="0.33.2"
    )  # same release row


def test_version_override_is_explicit_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    server = FakeServer(version="0.35.1")
    engine = engine_for(server, weights(0), verify=False)
    engine.send_weights()
    engine.send_weights()
    assert server.bodies("update_weights")[1]["update_info"][
        "names"
    ]  # unknown future: no reuse shorthand
    with caplog.at_level(logging.WARNING, "weightwire.trainer"):
        engine = engine_for(server, weights(0), verify=False, version_override="0.33")
    assert "server version 0.35.1 gated by override as 0.33" in caplog.text
    assert engine.features.basis == "user override: gated as 0.33 (server says 0.35.1)"
    engine.send_weights()
    engine.send_weights()
    assert server.bodies("update_weights")[-1]["update_info"] == {
        "names": [],
        "dtype_names": [],
        "shapes": [],
    }
    with pytest.raises(ValueError, match=r"version override '0\.40' is not a known release"):
        TrainerInitInfo(backend="fake_host", version_override="0.40")
