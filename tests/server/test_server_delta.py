"""Delta rounds against the reference server (``--replicas 2``, ``weightwire_tcp``): patches
land in both replicas' HF models with the round's dense tensors, all or nothing; a delta on
a round the server does not hold is refused before any byte, over HTTP, naming both tokens."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest
from _server_sender import TCPSender, VLLMStyleClient
from test_server_rounds import assert_serves, checksums, reference, sha  # noqa: F401

from weightwire.shared.delta import FLAT_I32, extract_host
from weightwire.shared.errors import DELTA_BASE_MISMATCH, TransferError
from weightwire.shared.routes import REFUSAL_FIELD


@pytest.fixture(scope="module")
def server(server_factory, tiny_llama: str):
    return server_factory(["--model", tiny_llama, "--replicas", "2"])


def stepped(weights: dict[str, np.ndarray], seed: int, density: float) -> dict[str, np.ndarray]:
    """About ``density`` of every tensor's elements moved (an optimizer step at low lr moves
    few of a low-precision model's elements)."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, array in weights.items():
        new = array.copy().reshape(-1)
        idx = rng.choice(new.size, size=max(1, int(density * new.size)), replace=False)
        new[idx] += rng.standard_normal(idx.size).astype(new.dtype) * 0.05
        out[name] = new.reshape(array.shape)
    return out


def delta_round(
    base: dict[str, np.ndarray], new: dict[str, np.ndarray], token: str, base_token: str
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The wire tensors and update info of a delta round: the norms dense, the rest patched."""
    wire: dict[str, np.ndarray] = {}
    patches: list[list[Any]] = []
    for name, array in new.items():
        if "norm" in name:
            wire[name] = array
            continue
        index, values = extract_host(base[name], array)
        wire[f"{name}@index"], wire[f"{name}@values"] = index, values
        patches.append([name, str(array.dtype), list(array.shape), int(index.size), FLAT_I32])
    info = {
        "names": list(wire),
        "dtype_names": [str(a.dtype) for a in wire.values()],
        "shapes": [list(a.shape) for a in wire.values()],
        "round_token": token,
        "delta_base": base_token,
        "patches": patches,
    }
    return wire, info


def refused_round(
    client: VLLMStyleClient, sender: TCPSender, wire: dict[str, np.ndarray], info: dict[str, Any]
) -> str:
    """Open a round and send ``wire``: the server refuses it with a 409 before any byte; the
    refusal's text."""
    client.start_weight_update()
    with pytest.raises(httpx.HTTPStatusError) as refused:
        sender.send_update(wire, info).result()
    assert refused.value.response.status_code == 409
    # the refusal named as a field too, for the trainer to read instead of the words
    assert refused.value.response.json()["error"][REFUSAL_FIELD] == DELTA_BASE_MISMATCH
    return refused.value.response.text


def dense_info(weights: dict[str, np.ndarray], token: str) -> dict[str, Any]:
    return {
        "names": list(weights),
        "dtype_names": [str(a.dtype) for a in weights.values()],
        "shapes": [list(a.shape) for a in weights.values()],
        "round_token": token,
    }


def test_delta_rounds_land_whole_and_a_wrong_base_is_refused(
    server,
    http: httpx.Client,
    base_weights,
    reference,  # noqa: F811  (the HF reference fixture of test_server_rounds)
) -> None:
    client = VLLMStyleClient(server.url)
    sender = TCPSender(client, replicas=2)
    sender.init(delta_rounds=True)
    try:
        first = stepped(base_weights, 1, 1.0)
        client.start_weight_update()
        sender.send_update(first, dense_info(first, "s:1")).result()
        client.finish_weight_update("s:1")
        assert checksums(http) == [sha(first)] * 2

        second = stepped(first, 2, 0.01)
        wire, info = delta_round(first, second, "s:2", "s:1")
        assert sum(a.nbytes for a in wire.values()) < sum(a.nbytes for a in first.values()) / 10
        client.start_weight_update()
        sender.send_update(wire, info).result()
        client.finish_weight_update("s:2")
        # verify: every replica's checksum of a patched tensor is over its full new value.
        assert_serves(http, reference, second)

        third = stepped(second, 3, 0.01)
        wire, info = delta_round(second, third, "s:3", "s:1")  # built on a round it replaced
        assert (
            "DeltaBaseMismatch: the round's patches were built on round 's:1' but this worker "
            "holds round 's:2'; send the round dense" in refused_round(client, sender, wire, info)
        )
        with pytest.raises(TransferError):  # the data link was torn down with the round
            for _ in range(50):
                sender.comm.broadcast(np.zeros(8, np.uint8), timeout=10)
        assert checksums(http) == [sha(second)] * 2
    finally:
        sender.close()


def test_torch_trainer_delta_rounds_verified_on_both_replicas(
    server,
    http: httpx.Client,
    tiny_llama: str,
    reference,  # noqa: F811
) -> None:
    """The torch trainer engine with ``delta="auto"`` and ``verify=True``: optimizer steps at
    lr 1e-6 go as patches and changed tensors; the digest check passes on both replicas
    (their checksums are over the patched tensors whole) and the model serves HF's output."""
    import torch
    from transformers import AutoModelForCausalLM

    from weightwire.control import HTTPWeightSyncClient
    from weightwire.torch_side.sender.engine import TorchTrainerEngine
    from weightwire.torch_side.sender.source import ModuleSource
    from weightwire.trainer.config import TrainerInitInfo

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama).float()
    opt = torch.optim.SGD(hf.parameters(), lr=1e-6)
    ids = torch.tensor([[5, 17, 42, 9, 77, 3, 12, 8]])
    info = TrainerInitInfo(backend="weightwire_tcp", delta="auto", verify=True)
    with HTTPWeightSyncClient(server.url, timeout=60) as client:
        engine = TorchTrainerEngine.trainer_init(info, client=client, source=ModuleSource(hf))
        try:
            first = engine.send_weights(weight_version="t-0")
            assert first.density is None and first.verify.mode == "digest"
            for step in (1, 2, 3):
                hf(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
                m = engine.send_weights(weight_version=f"t-{step}")
                assert m.density is not None and m.wire_bytes < m.dense_bytes, m.summary()
                assert m.verify.mode == "digest"
            weights = {n: p.detach().numpy() for n, p in hf.state_dict().items()}
            assert_serves(http, reference, weights)
        finally:
            engine.shutdown()


def committed_pair(
    client: VLLMStyleClient, sender: TCPSender, start: dict[str, np.ndarray], tag: str
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A dense round ``tag:1``, then a delta round ``tag:2`` on it, both committed."""
    first = stepped(start, 21, 1.0)
    client.start_weight_update()
    sender.send_update(first, dense_info(first, f"{tag}:1")).result()
    client.finish_weight_update(f"{tag}:1")
    second = stepped(first, 22, 0.01)
    wire, info = delta_round(first, second, f"{tag}:2", f"{tag}:1")
    client.start_weight_update()
    sender.send_update(wire, info).result()
    client.finish_weight_update(f"{tag}:2")
    return first, second


def resend_dense(url: str, weights: dict[str, np.ndarray], token: str) -> None:
    """What a trainer does after a refused base: the round again, dense, in a new session."""
    client = VLLMStyleClient(url)
    sender = TCPSender(client, replicas=2)
    sender.init(delta_rounds=True)
    try:
        client.start_weight_update()
        sender.send_update(weights, dense_info(weights, token)).result()
        client.finish_weight_update(token)
    finally:
        sender.close()


@pytest.mark.timeout(120)
def test_a_delta_round_applied_in_place_commits_and_serves(
    server,
    http: httpx.Client,
    base_weights,
    reference,  # noqa: F811
) -> None:
    """Stage budget 0: the delta round's dense tensors land in place as they arrive, its
    patches at finish. The finish used to wait for the model lock it held itself (a 504
    after --op-timeout, then every completion and init hung)."""
    client = VLLMStyleClient(server.url, timeout=60)
    sender = TCPSender(client, replicas=2)
    sender.init(delta_rounds=True, stage_budget_bytes=0)
    try:
        _, second = committed_pair(client, sender, base_weights, "p")
        assert_serves(http, reference, second)
        third = stepped(second, 23, 0.01)  # the in-place round's token is the next base
        wire, info = delta_round(second, third, "p:3", "p:2")
        client.start_weight_update()
        sender.send_update(wire, info).result()
        client.finish_weight_update("p:3")
        assert_serves(http, reference, third)
        assert http.get("/health").status_code == 200
    finally:
        sender.close()


def _sleep_level_2(http: httpx.Client) -> None:
    assert http.post("/sleep", params={"level": 2}).status_code == 200
    assert http.post("/wake_up").status_code == 200


def _reset(http: httpx.Client) -> None:
    assert http.post("/weight_checker", json={"action": "reset"}).json() == {"status": "reset"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("change", [_sleep_level_2, _reset], ids=["sleep_level_2", "reset"])
def test_weights_changed_outside_a_round_forget_the_delta_base(
    server,
    http: httpx.Client,
    base_weights,
    reference,  # noqa: F811
    change,
) -> None:
    """Sleep level 2 (+ wake: zeros) and a reset change every weight without a round: the
    next delta round on the last committed round is refused before any byte (its patches
    would land on zeros and serve under the new version), and the dense resend serves."""
    client = VLLMStyleClient(server.url)
    sender = TCPSender(client, replicas=2)
    sender.init(delta_rounds=True)
    try:
        _, second = committed_pair(client, sender, base_weights, "z")
        change(http)
        zeros = checksums(http)
        third = stepped(second, 24, 1.0)  # one RL step touches every tensor
        wire, info = delta_round(second, third, "z:3", "z:2")
        assert (
            "DeltaBaseMismatch: the round's patches were built on round 'z:2' but this worker "
            "holds round None; send the round dense" in refused_round(client, sender, wire, info)
        )
        assert checksums(http) == zeros
    finally:
        sender.close()
    resend_dense(server.url, third, "z:3")
    assert_serves(http, reference, third)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("budget", [1 << 30, 0], ids=["staged", "in_place"])
def test_a_failed_delta_round_forgets_the_base(
    server,
    http: httpx.Client,
    base_weights,
    reference,  # noqa: F811
    budget: int,
) -> None:
    """A delta round whose indices are not strictly increasing is refused naming the tensor,
    before any patch is written; the base died with the round, so the same delta sent
    correctly is refused too, and the dense resend serves."""
    client = VLLMStyleClient(server.url, timeout=60)
    sender = TCPSender(client, replicas=2)
    sender.init(delta_rounds=True, stage_budget_bytes=budget)
    try:
        _, second = committed_pair(client, sender, base_weights, "f")
        before = checksums(http)
        third = stepped(second, 25, 0.05)
        wire, info = delta_round(second, third, "f:3", "f:2")
        name = "model.layers.0.mlp.up_proj.weight"
        index, values = wire[f"{name}@index"], wire[f"{name}@values"]
        wire[f"{name}@index"], wire[f"{name}@values"] = index[::-1].copy(), values[::-1].copy()
        client.start_weight_update()
        with pytest.raises(httpx.HTTPStatusError) as failed:
            sender.send_update(wire, info).result()
        assert f"patch of {name!r}: indices must be strictly increasing" in (
            failed.value.response.text
        )
        if budget:  # staged: the norms sent dense stayed out too
            assert checksums(http) == before
    finally:
        sender.close()
    client = VLLMStyleClient(server.url, timeout=60)
    sender = TCPSender(client, replicas=2)
    sender.init(delta_rounds=True, stage_budget_bytes=budget)
    try:
        wire, info = delta_round(second, third, "f:3", "f:2")
        assert "built on round 'f:2' but this worker holds round None" in refused_round(
            client, sender, wire, info
        )
    finally:
        sender.close()
    resend_dense(server.url, third, "f:3")
    assert_serves(http, reference, third)


@pytest.mark.timeout(120)
def test_torch_trainer_resends_dense_after_sleep_level_2(
    server,
    http: httpx.Client,
    tiny_llama: str,
    reference,  # noqa: F811
) -> None:
    """The torch trainer with ``delta="auto"`` and ``verify=True`` across ``/sleep?level=2``
    + ``/wake_up``: its next delta round is refused before any byte, the same round goes
    dense in the same call, the digests agree and the model serves the trainer's weights
    (it used to commit patches onto zeros and fail verification after the commit)."""
    import torch
    from transformers import AutoModelForCausalLM

    from weightwire.control import HTTPWeightSyncClient
    from weightwire.torch_side.sender.engine import TorchTrainerEngine
    from weightwire.torch_side.sender.source import ModuleSource
    from weightwire.trainer.config import TrainerInitInfo

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama).float()
    opt = torch.optim.SGD(hf.parameters(), lr=1e-6)
    ids = torch.tensor([[5, 17, 42, 9, 77, 3, 12, 8]])

    def step() -> None:
        hf(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    info = TrainerInitInfo(backend="weightwire_tcp", delta="auto", verify=True)
    with HTTPWeightSyncClient(server.url, timeout=60) as client:
        engine = TorchTrainerEngine.trainer_init(info, client=client, source=ModuleSource(hf))
        try:
            engine.send_weights(weight_version="s-0")
            step()
            assert engine.send_weights(weight_version="s-1").density is not None
            _sleep_level_2(http)
            step()
            m = engine.send_weights(weight_version="s-2")
            assert m.density is None and m.verify.mode == "digest", m.summary()
            weights = {n: p.detach().numpy() for n, p in hf.state_dict().items()}
            assert_serves(http, reference, weights)
        finally:
            engine.shutdown()


def test_torch_cow_overlapped_rounds_send_the_weights_of_send_time(
    server, http: httpx.Client, tiny_llama: str
) -> None:
    """``snapshot="cow"`` (nothing copied up front) with ``delta="auto"``: each overlapped round
    runs while the next optimizer step trains; after each, both replicas hold exactly the
    weights of its ``send_weights`` call (not the step's, not a mix), and the step's copies
    are the snapshot's only memory."""
    import torch
    from transformers import AutoModelForCausalLM

    from weightwire.control import HTTPWeightSyncClient
    from weightwire.torch_side.sender.engine import TorchTrainerEngine
    from weightwire.torch_side.sender.source import ModuleSource
    from weightwire.trainer.config import TrainerInitInfo

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama).float()
    opt = torch.optim.SGD(hf.parameters(), lr=1e-3)
    ids = torch.tensor([[5, 17, 42, 9, 77, 3, 12, 8]])
    info = TrainerInitInfo(backend="weightwire_tcp", snapshot="cow", delta="auto", verify=True)
    with HTTPWeightSyncClient(server.url, timeout=60) as client:
        engine = TorchTrainerEngine.trainer_init(info, client=client, source=ModuleSource(hf))
        try:
            for step in range(3):
                sent = {n: p.detach().numpy().copy() for n, p in hf.state_dict().items()}
                handle = engine.send_weights(weight_version=f"cow-{step}", wait=False)
                hf(input_ids=ids, labels=ids).loss.backward()
                opt.step()  # overlapped with the round: copies first or waits, never reaches it
                opt.zero_grad()
                handle.result()
                sums = checksums(http)
                assert sums[0] == sums[1] == sha(sent), f"round {step}"
            assert engine.snapshot_bytes == 0
        finally:
            engine.shutdown()
