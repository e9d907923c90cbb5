"""Backends: the exact worker init payloads, and the TCP rendezvous lifecycle."""

from __future__ import annotations

import base64
import socket

import pytest

from weightwire.backends import get_backend
from weightwire.backends.nccl.info import NCCLInitInfo, WeightwireNCCLInitInfo
from weightwire.backends.nccl.trainer import NCCLBackend, WeightwireNCCLBackend
from weightwire.backends.tcp.info import TCPInitInfo
from weightwire.backends.tcp.trainer import TCPBackend
from weightwire.shared.timeouts import Timeouts
from weightwire.shared.version import ServerFeatures
from weightwire.trainer import TrainerInitInfo

UID = bytes(range(128))


def test_stock_nccl_payload_is_exactly_vllms_fields() -> None:
    info = TrainerInitInfo(backend="nccl", packed_buffer_size_bytes=1 << 28, packed_num_buffers=3)
    payload = NCCLBackend()._payload(info, UID, 5)
    assert payload == {
        "nccl_unique_id_b64": base64.b64encode(UID).decode(),
        "rank_offset": 1,
        "world_size": 5,
        "packed": True,
        "packed_buffer_size_bytes": 1 << 28,
        "packed_num_buffers": 3,
    }
    assert NCCLInitInfo.from_dict(payload).unique_id_bytes == UID
    assert "nccl_unique_id_b64=<redacted>" in repr(NCCLInitInfo.from_dict(payload))


def test_weightwire_nccl_payload_adds_the_worker_timeout_and_stage_budget() -> None:
    info = TrainerInitInfo(
        backend="weightwire_nccl",
        packed=False,
        timeouts=Timeouts(transfer_s=42),
        stage_budget_bytes=7,
    )
    payload = WeightwireNCCLBackend()._payload(info, UID, 2)
    assert (
        payload["timeout_s"] == 42.0
        and payload["packed"] is False
        and payload["stage_budget_bytes"] == 7
    )
    assert set(payload) == set(NCCLBackend()._payload(info, UID, 2)) | {
        "timeout_s",
        "stage_budget_bytes",
    }
    assert WeightwireNCCLInitInfo.from_dict(payload).timeout_s == 42.0


@pytest.mark.parametrize(
    ("version", "ok"), [("0.29.9", False), ("0.30.0", True), ("0.33.0+weightwire.0.1.0", True)]
)
def test_nccl_backends_need_unique_id_rendezvous(version: str, ok: bool) -> None:
    features = ServerFeatures.for_version(version)
    for name in ("nccl", "weightwire_nccl"):
        if ok:
            get_backend(name).check_server(features)
        else:
            with pytest.raises(ValueError, match="unique_id_rendezvous"):
                get_backend(name).check_server(features)
    get_backend("weightwire_tcp").check_server(features)  # the TCP plugin has no such gate


def test_tcp_rendezvous_payload_and_cancel() -> None:
    info = TrainerInitInfo(
        backend="weightwire_tcp", packed_buffer_size_bytes=1 << 20, timeouts=Timeouts(transfer_s=9)
    )
    rdv = TCPBackend().open(info, world_size=3)
    parsed = TCPInitInfo.from_dict(rdv.payload)
    assert (parsed.host, parsed.rank_offset, parsed.world_size, parsed.timeout_s) == (
        "127.0.0.1",
        1,
        3,
        9.0,
    )
    assert parsed.packed_buffer_size_bytes == 1 << 20 and len(parsed.secret) == 128
    assert rdv.payload["secret_b64"] not in repr(rdv) and "redacted" in repr(rdv)
    with socket.create_connection((parsed.host, parsed.port), timeout=2):
        pass  # listening now
    rdv.cancel()
    with pytest.raises(OSError):
        socket.create_connection((parsed.host, parsed.port), timeout=2)
