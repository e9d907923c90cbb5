"""Real rounds against a ``--replicas 2`` server over ``weightwire_tcp``, driven with the
exact bodies vLLM 0.33's ``HTTPVLLMWeightSyncClient`` posts and a test-local sender."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from _server_sender import TCPSender, VLLMStyleClient, update_info_of

from weightwire.shared.errors import TransferError

PROMPT = "The trainer sends"


@pytest.fixture(scope="module")
def server(server_factory, tiny_llama: str):
    return server_factory(["--model", tiny_llama, "--replicas", "2"])


@pytest.fixture(scope="module")
def reference(tiny_llama: str):
    """Teacher-forced logprobs of given tokens under given weights, computed locally with HF."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama).eval()

    def logprobs(
        weights: dict[str, np.ndarray], prompt_ids: list[int], token_ids: list[int]
    ) -> list[float]:
        model.load_state_dict(
            {k: torch.from_numpy(v.copy()) for k, v in weights.items()}, strict=True
        )
        ids = torch.tensor([prompt_ids + token_ids[:-1]])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
        pos = torch.arange(len(prompt_ids) - 1, ids.shape[1])
        return logp[pos, torch.tensor(token_ids)].tolist()

    return logprobs


def perturbed(weights: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        k: (v + rng.standard_normal(v.shape).astype(np.float32) * 0.05) for k, v in weights.items()
    }


def sha(weights: dict[str, np.ndarray]) -> dict[str, str]:
    return {
        k: hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest() for k, v in weights.items()
    }


def greedy(http: httpx.Client) -> dict:
    resp = http.post(
        "/v1/completions",
        json={
            "prompt": PROMPT,
            "max_tokens": 8,
            "temperature": 0,
            "logprobs": 1,
            "return_token_ids": True,
            "ignore_eos": True,
        },
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def checksums(http: httpx.Client) -> list[dict[str, str]]:
    return http.post("/weight_checker", json={"action": "checksum"}).json()["replica_checksums"]


def assert_serves(http: httpx.Client, reference, weights: dict[str, np.ndarray]) -> dict:
    sums = checksums(http)
    assert len(sums) == 2 and sums[0] == sums[1] == sha(weights)
    choice = greedy(http)
    want = reference(weights, choice["prompt_token_ids"], choice["token_ids"])
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"], want, atol=2e-4)
    return choice


def one_session(url: str, weights: dict[str, np.ndarray], version: str) -> None:
    """A fresh init and one round, as a vLLM-style trainer would send it to both replicas."""
    sender = TCPSender(VLLMStyleClient(url), replicas=2)
    try:
        sender.init()
        sender.round(weights, version)
    finally:
        sender.close()


def test_vllm_client_bodies_drive_a_real_round(
    server, http: httpx.Client, base_weights, reference
) -> None:
    before = assert_serves(http, reference, base_weights)
    assert http.get("/get_world_size").json() == {"world_size": 2}
    new = perturbed(base_weights, 1)
    one_session(server.url, new, "step-1")
    assert http.get("/weight_info").json()["weight_version"] == "step-1"
    after = assert_serves(http, reference, new)
    assert after["logprobs"]["token_logprobs"] != before["logprobs"]["token_logprobs"]


def test_list_form_and_metadata_reuse(server, http: httpx.Client, base_weights, reference) -> None:
    client = VLLMStyleClient(server.url)
    sender = TCPSender(client, replicas=2, buffer_size=50_000)
    new2, new3 = perturbed(base_weights, 2), perturbed(base_weights, 3)
    try:
        sender.init()
        client.start_weight_update()
        info = update_info_of(new2)
        sender.send_update(
            new2, update_info=[info, info]
        ).result()  # one entry per worker, as vLLM DP
        client.finish_weight_update("step-2")
        assert_serves(http, reference, new2)
        # 0.33 shorthand: empty lists reuse the previous round's metadata (same order, same shapes).
        client.start_weight_update()
        sender.send_update(
            new3, update_info={"names": [], "dtype_names": [], "shapes": []}
        ).result()
        client.finish_weight_update("step-3")
    finally:
        sender.close()
    assert http.get("/weight_info").json()["weight_version"] == "step-3"
    assert_serves(http, reference, new3)


EMPTY_LISTS = {"names": [], "dtype_names": [], "shapes": []}


def test_metadata_reuse_with_no_previous_listing_is_refused_before_the_workers(
    server, http: httpx.Client, base_weights, reference
) -> None:
    """Empty lists on a session's first update ("the previous round's tensors") have nothing
    to reuse: the update's own checks answer 400 saying so, before any worker acts; the
    open round and the session stay usable (was: the workers refused it, which ended the
    session). The round in one request is refused as its start, opening no round."""
    client = VLLMStyleClient(server.url)
    sender = TCPSender(client, replicas=2)
    new = perturbed(base_weights, 4)
    try:
        sender.init()
        resp = http.post(
            "/update_weights?start=true&finish=true", json={"update_info": EMPTY_LISTS}
        )
        assert resp.status_code == 400, resp.text
        detail = resp.json()["detail"]
        assert detail.startswith("start_weight_update refused: the update's"), detail
        assert "no previous round's tensor list to reuse" in detail, detail
        assert http.get("/weight_info").json()["session"]["state"] == "ready"
        client.start_weight_update()
        for info, where in ((EMPTY_LISTS, "update_info"), ([EMPTY_LISTS] * 2, "update_info[0]")):
            resp = http.post("/update_weights", json={"update_info": info})
            assert resp.status_code == 400, resp.text
            detail = resp.json()["detail"]
            assert detail.startswith(f"{where} lists no tensors"), detail
            assert "no previous round's tensor list to reuse" in detail, detail
            assert "send the round's names, dtype_names and shapes" in detail, detail
            session = http.get("/weight_info").json()["session"]
            assert session["state"] == "round_active", session
        sender.send_update(new).result()  # the open round takes a listing update
        client.finish_weight_update("step-4")
    finally:
        sender.close()
    assert http.get("/weight_info").json()["weight_version"] == "step-4"
    assert_serves(http, reference, new)


def test_init_and_update_shapes_that_do_not_fit_two_replicas(server, http: httpx.Client) -> None:
    info = {
        "host": "127.0.0.1",
        "port": 9,
        "secret_b64": "QUJD" * 42 + "QUI=",
        "rank_offset": 1,
        "world_size": 2,
    }
    resp = http.post("/init_weight_transfer_engine", json={"init_info": info})
    assert resp.status_code == 422 and "world_size 2 is too small" in resp.json()["detail"]
    assert "ranks 1..2" in resp.json()["detail"]


def _wait_for_failure(http: httpx.Client, failed_before: int, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = http.get("/weight_info").json()
        s = info["session"]
        if (
            s["state"] == "uninitialized"
            and s["busy"] is None
            and s["rounds_failed"] > failed_before
        ):
            return info
        time.sleep(0.1)
    raise AssertionError(f"the round did not fail within {timeout}s: {info}")


def test_sender_killed_mid_round_keeps_old_weights(
    server, http: httpx.Client, base_weights, reference, tmp_path: Path
) -> None:
    before_info = http.get("/weight_info").json()
    before_sums = checksums(http)
    before = greedy(http)
    npz = tmp_path / "w.npz"
    np.savez(npz, **perturbed(base_weights, 99))
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("_server_sender.py"))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=os.environ.copy(),
    )
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(
            json.dumps(
                {
                    "base_url": server.url,
                    "replicas": 2,
                    "weights_npz": str(npz),
                    "buffer_size": 8192,
                }
            )
            + "\n"
        )
        proc.stdin.flush()
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(60)
        assert line == ["sent-one-chunk\n"], line
        proc.kill()  # mid-broadcast: one chunk of many landed
    finally:
        proc.kill()
        proc.wait(10)
    info = _wait_for_failure(http, before_info["session"]["rounds_failed"])
    err = info["session"]["last_error"]
    assert "update_weights" in err and "replica" in err and ("PeerLost" in err or "lost" in err), (
        err
    )
    assert info["weight_version"] == before_info["weight_version"]
    assert checksums(http) == before_sums
    after = greedy(http)
    assert after["token_ids"] == before["token_ids"]
    assert (
        after["logprobs"]["token_logprobs"] == before["logprobs"]["token_logprobs"]
    )  # bit-identical
    # The next session works.
    new = perturbed(base_weights, 5)
    one_session(server.url, new, "after-kill")
    assert http.get("/weight_info").json()["weight_version"] == "after-kill"
    assert_serves(http, reference, new)


def test_bad_tensor_fails_the_round_and_keeps_old_weights(
    server, http: httpx.Client, base_weights
) -> None:
    before_sums, version = checksums(http), http.get("/weight_info").json()["weight_version"]
    client = VLLMStyleClient(server.url)
    sender = TCPSender(client, replicas=2)
    bad = {"model.norm.weight": np.ones(65, dtype=np.float32)}  # the parameter has 64 entries
    try:
        sender.init()
        client.start_weight_update()
        with pytest.raises(httpx.HTTPStatusError) as info:
            try:
                sender.send_update(bad).result()
            except TransferError:  # the server may drop the group before our send completes
                raise AssertionError(
                    "the POST, not the broadcast, must report the failure"
                ) from None
    finally:
        sender.close()
    resp = info.value.response
    assert resp.status_code == 400, resp.text
    detail = resp.json()["detail"]
    assert "replica" in detail and "model.norm.weight" in detail and "[65]" in detail
    assert f"weight_version {version!r}" in detail
    assert checksums(http) == before_sums
    assert http.get("/weight_info").json()["session"]["state"] == "uninitialized"


def test_weight_checker_compare_and_reset(
    server, http: httpx.Client, base_weights, reference
) -> None:
    current = checksums(http)[0]
    assert http.post("/weight_checker", json={"action": "compare", "baseline": current}).json() == {
        "match": True,
        "mismatches": [],
        "replica_mismatches": [[], []],
    }
    off = {**current, "model.norm.weight": "0" * 64}
    off.pop("lm_head.weight")
    got = http.post("/weight_checker", json={"action": "compare", "baseline": off}).json()
    assert got["match"] is False and got["mismatches"] == ["lm_head.weight", "model.norm.weight"]
    assert http.post("/weight_checker", json={"action": "reset"}).json() == {"status": "reset"}
    zeros = {k: np.zeros_like(v) for k, v in base_weights.items()}
    assert checksums(http) == [sha(zeros), sha(zeros)]
    one_session(server.url, base_weights, "restored")
    assert_serves(http, reference, base_weights)


def test_one_failing_replica_fails_the_round_for_all(
    server, http: httpx.Client, base_weights
) -> None:
    """vLLM's list form gives replica 1 a transposed lm_head (same bytes, wrong shape): only
    replica 1 fails, yet replica 0's staged round is aborted too and nothing changes."""
    before_sums, version = checksums(http), http.get("/weight_info").json()["weight_version"]
    new = perturbed(base_weights, 11)
    good = update_info_of(new)
    bad = json.loads(json.dumps(good))
    i = bad["names"].index("lm_head.weight")
    bad["shapes"][i] = bad["shapes"][i][::-1]
    client = VLLMStyleClient(server.url)
    sender = TCPSender(client, replicas=2)
    try:
        sender.init()
        client.start_weight_update()
        with pytest.raises(httpx.HTTPStatusError) as info:
            try:
                sender.send_update(new, update_info=[good, bad]).result()
            except TransferError:
                raise AssertionError(
                    "the POST, not the broadcast, must report the failure"
                ) from None
    finally:
        sender.close()
    detail = info.value.response.json()["detail"]
    assert info.value.response.status_code == 400
    assert "replica 1: " in detail and "replica 0: " not in detail and "lm_head.weight" in detail
    assert checksums(http) == before_sums
    after = http.get("/weight_info").json()
    assert after["weight_version"] == version and after["session"]["state"] == "uninitialized"


def test_stalled_sender_times_out_and_keeps_old_weights(
    server, http: httpx.Client, base_weights
) -> None:
    before_sums, version = checksums(http), http.get("/weight_info").json()["weight_version"]
    client = VLLMStyleClient(server.url)
    sender = TCPSender(client, replicas=2)
    try:
        sender.init(timeout_s=2.0)
        client.start_weight_update()
        started = time.monotonic()
        with pytest.raises(httpx.HTTPStatusError) as info:
            client.update_weights(
                update_info_of(perturbed(base_weights, 12))
            )  # and never broadcast
        elapsed = time.monotonic() - started
    finally:
        sender.close()
    resp = info.value.response
    assert resp.status_code == 504, resp.text
    assert "replica" in resp.json()["detail"] and "TransferTimeout" in resp.json()["detail"]
    assert 1.5 < elapsed < 20
    assert checksums(http) == before_sums
    assert http.get("/weight_info").json()["weight_version"] == version
