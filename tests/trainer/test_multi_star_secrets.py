"""Several broadcasters over ``weightwire_tcp``: no star's secret is ever written to the
trainer group's store (any client of it can read it); each star's secret is agreed
between its broadcaster and rank 0 (``shared.keyshare``) and reaches the workers only in
the init POST. Real TCP stars, a real TCP worker (the loopback receiver process)."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.trainer.fakes import DictSource
from weightwire.shared.dtypes import wire_name_of_numpy
from weightwire.shared.errors import ConfigError
from weightwire.shared.keyshare import KeyShare
from weightwire.shared.owned import OwnedSource
from weightwire.testing.loopback import LoopbackClient, spawn_loopback
from weightwire.tools.demo.doctor import NumpyTrainerEngine
from weightwire.trainer.config import TrainerInitInfo
from weightwire.trainer.group import DictGroup

TENSORS = {
    "model.layers.0.w": np.arange(64, dtype=np.float32),
    "model.layers.1.w": np.full(64, 3.0, np.float32),
}


class RecordingClient(LoopbackClient):
    """The loopback client, keeping every init info it posts (the secrets' one legitimate path)."""

    posted: list[dict[str, Any]]

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.posted.append(init_info)
        super().init_weight_transfer_engine(init_info)


@pytest.fixture(scope="module")
def receiver() -> Iterator[RecordingClient]:
    proc, plain = spawn_loopback("weightwire_tcp", "cpu")
    client = RecordingClient(plain.address)
    client.posted = []
    try:
        yield client
    finally:
        proc.kill()
        proc.wait(10)


def _describe(array: Any) -> tuple[str, tuple[int, ...]]:
    return wire_name_of_numpy(array.dtype), tuple(array.shape)


def test_star_secrets_never_reach_the_trainer_store(receiver: RecordingClient) -> None:
    groups = DictGroup.make(2)
    errors: list[BaseException | None] = [None, None]

    def rank(r: int) -> None:
        try:
            source = OwnedSource(
                DictSource(dict(TENSORS), _describe), lambda n: 0 if ".0." in n else 1, rank=r
            )
            cfg = TrainerInitInfo(backend="weightwire_tcp", rank=r, pause_mode=None)
            engine = NumpyTrainerEngine.trainer_init(
                cfg, client=receiver, source=source, group=groups[r]
            )
            try:
                engine.send_weights(weight_version="1")
            finally:
                engine.shutdown()
        except BaseException as exc:  # reported per rank below
            errors[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [None, None], errors
    # The round landed: both broadcasters' tensors, bit-exact, on the worker.
    (checked,) = receiver.weight_checker("checksum")
    assert checked["checksums"] == {
        n: hashlib.sha256(a.tobytes()).hexdigest() for n, a in TENSORS.items()
    }
    # The worker got broadcaster 1's star (address and secret) through the init POST ...
    (info,) = receiver.posted
    (star,) = info["sources"]
    secrets_b64 = [info["secret_b64"], star["secret_b64"]]
    # ... and the store holds that star's address and public key share, but no secret.
    store = groups[0].store
    assert isinstance(store, dict)
    endpoints = [json.loads(v) for k, v in store.items() if "/endpoint/" in k]
    assert endpoints and all(set(e) == {"host", "port", "keyshare"} for e in endpoints), endpoints
    assert (endpoints[0]["host"], endpoints[0]["port"]) == (star["host"], star["port"])
    for key, value in store.items():
        assert "secret" not in value, (key, value)
        for secret in secrets_b64:
            assert secret not in value and secret[:24] not in value, key


def test_key_shares_agree_and_refuse_degenerate_values() -> None:
    a, b = KeyShare.new(), KeyShare.new()
    one = a.secret_with(b.public_b64, length=128, context=b"c")
    assert one == b.secret_with(a.public_b64, length=128, context=b"c") and len(one) == 128
    assert one != a.secret_with(b.public_b64, length=128, context=b"other")
    assert str(b._exponent) not in repr(b) and b.public_b64 in repr(b)
    for bad in (
        "AQ==",
        "x" * 10,
        None,
        __import__("base64").b64encode((1).to_bytes(256, "big")).decode(),
    ):
        with pytest.raises(ConfigError, match="key share"):
            a.secret_with(bad, length=128, context=b"c")
