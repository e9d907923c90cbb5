"""weightwire_nccl address/port mode: the unique id travels through a torch TCPStore.

The NCCL join itself needs GPUs (``test_nccl_gpu.py``); the store exchange does not.
"""

from __future__ import annotations

import secrets
import threading
import time

import pytest

from tests.ranks import free_port
from weightwire.backends.nccl.worker import fetch_unique_id, publish_unique_id

pytestmark = pytest.mark.timeout(60)


def test_unique_id_round_trips_even_when_the_worker_dials_first():
    port = free_port()
    uid = secrets.token_bytes(128)
    got: list[bytes] = []
    stores = []

    def late_publish() -> None:
        time.sleep(0.5)
        stores.append(publish_unique_id("127.0.0.1", port, uid, timeout_s=10))

    t = threading.Thread(target=late_publish)
    t.start()
    got.append(fetch_unique_id("127.0.0.1", port, timeout_s=10))
    t.join(timeout=10)
    assert got == [uid]


def test_fetch_times_out_with_a_clear_error():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=rf"TCPStore at 127.0.0.1:{port} within 2s"):
        fetch_unique_id("127.0.0.1", port, timeout_s=2)
    assert time.monotonic() - t0 < 20


def test_publish_refuses_a_wrong_size_id():
    with pytest.raises(ValueError, match="128 bytes"):
        publish_unique_id("127.0.0.1", free_port(), b"short", timeout_s=1)
