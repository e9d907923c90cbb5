"""Init infos: every malformed payload is refused with a ``ValueError`` naming the field, valid
ones round-trip through JSON, secrets never reach a repr. (UpdateInfo and ParamMeta:
``test_update_info.py``.)"""

from __future__ import annotations

import base64
import json

import pytest

from tests.shared.vllm_nccl import UNIQUE_ID_KEYS
from weightwire import NCCLInitInfo, TCPInitInfo, WeightwireNCCLInitInfo
from weightwire.shared import UpdateInfo
from weightwire.shared.info import DEFAULT_PACKED_BUFFER_SIZE_BYTES, encode_secret

# Bytes 0xfb 0xff encode to "+/" in standard base64 and to "-_" in the URL-safe
# alphabet, so this id tells the two apart.
UID = bytes([0xFB, 0xFF, 0xBF] * 42 + [0xFB, 0xFF])
UID_B64 = encode_secret(UID)
SECRET = bytes(range(128))
SECRET_B64 = encode_secret(SECRET)


def nccl_uid(**over: object) -> dict:
    base = {"nccl_unique_id_b64": UID_B64, "rank_offset": 1, "world_size": 3}
    return {**base, **over}


def nccl_store(**over: object) -> dict:
    base = {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
    return {**base, **over}


def tcp(**over: object) -> dict:
    base = {
        "host": "127.0.0.1",
        "port": 40000,
        "secret_b64": SECRET_B64,
        "rank_offset": 1,
        "world_size": 2,
    }
    return {**base, **over}


def without(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


def test_uid_fixture_really_differs_between_alphabets() -> None:
    assert "+" in UID_B64 and "/" in UID_B64
    assert "-" in base64.urlsafe_b64encode(UID).decode()


# --- NCCLInitInfo (and its weightwire subclass: same rules) ---------------------

NCCL_BAD = {
    "missing_rank_offset": (
        without(nccl_uid(), "rank_offset"),
        "missing required field 'rank_offset'",
    ),
    "missing_world_size": (
        without(nccl_uid(), "world_size"),
        "missing required field 'world_size'",
    ),
    "unknown_key": (nccl_uid(packed_buffer=5), r"unknown keys \['packed_buffer'\]"),
    "url_safe_b64": (
        nccl_uid(nccl_unique_id_b64=base64.urlsafe_b64encode(UID).decode()),
        "nccl_unique_id_b64",
    ),
    "id_127_bytes": (nccl_uid(nccl_unique_id_b64=encode_secret(UID[:127])), "nccl_unique_id_b64"),
    "id_129_bytes": (nccl_uid(nccl_unique_id_b64=encode_secret(UID + b"x")), "nccl_unique_id_b64"),
    "id_unpadded": (nccl_uid(nccl_unique_id_b64=UID_B64.rstrip("=") + "A"), "nccl_unique_id_b64"),
    "id_with_newline": (
        nccl_uid(nccl_unique_id_b64=UID_B64[:-4] + "\n" + UID_B64[-3:]),
        "nccl_unique_id_b64",
    ),
    "id_not_str": (nccl_uid(nccl_unique_id_b64=list(UID)), "nccl_unique_id_b64"),
    "both_modes": (
        nccl_uid(master_address="h", master_port=1),
        "master_address.*nccl_unique_id_b64",
    ),
    "no_mode": (without(nccl_uid(), "nccl_unique_id_b64"), "rendezvous"),
    "address_without_port": (without(nccl_store(), "master_port"), "master_port"),
    "empty_address": (nccl_store(master_address=""), "master_address"),
    "port_zero": (nccl_store(master_port=0), "master_port"),
    "port_too_big": (nccl_store(master_port=65536), "master_port"),
    "port_str": (nccl_store(master_port="29500"), "master_port"),
    "bool_world_size": (nccl_uid(world_size=True), "world_size must be int, got bool"),
    "bool_rank_offset": (nccl_uid(rank_offset=True), "rank_offset must be int"),
    "float_world_size": (nccl_uid(world_size=3.0), "world_size must be int"),
    "int_packed": (nccl_uid(packed=1), "packed must be bool"),
    "world_size_one": (nccl_uid(world_size=1, rank_offset=1), "world_size"),
    "world_size_huge": (nccl_uid(world_size=10**30), "world_size"),
    "rank_offset_zero": (nccl_uid(rank_offset=0), "rank_offset"),
    "rank_offset_at_world": (nccl_uid(rank_offset=3), "rank_offset"),
    "buffer_zero": (nccl_uid(packed_buffer_size_bytes=0), "packed_buffer_size_bytes"),
    "buffer_huge": (nccl_uid(packed_buffer_size_bytes=1 << 40), "packed_buffer_size_bytes"),
    "buffer_negative": (nccl_uid(packed_buffer_size_bytes=-1), "packed_buffer_size_bytes"),
    "num_buffers_zero": (nccl_uid(packed_num_buffers=0), "packed_num_buffers"),
    "num_buffers_huge": (nccl_uid(packed_num_buffers=10**6), "packed_num_buffers"),
    "null_required": (nccl_uid(world_size=None), "world_size must be int, got NoneType"),
    "not_object": ([nccl_uid()], "must be a JSON object"),
}


@pytest.mark.parametrize("cls", [NCCLInitInfo, WeightwireNCCLInitInfo])
@pytest.mark.parametrize("case", sorted(NCCL_BAD))
def test_nccl_init_info_rejects(cls: type[NCCLInitInfo], case: str) -> None:
    payload, match = NCCL_BAD[case]
    with pytest.raises(ValueError, match=match):
        cls.from_dict(payload)
    with pytest.raises(ValueError, match=match):
        cls.from_json(json.dumps(payload))


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (0, "timeout_s"),
        (-1.0, "timeout_s"),
        (86_401, "timeout_s"),
        (True, "timeout_s must be float"),
        ("5", "timeout_s must be float"),
        (10**400, "timeout_s"),
    ],
)
def test_weightwire_nccl_timeout(bad: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        WeightwireNCCLInitInfo.from_dict(nccl_uid(timeout_s=bad))


@pytest.mark.parametrize("text", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_weightwire_nccl_timeout_non_finite_json(text: str) -> None:
    body = json.dumps(nccl_uid()).rstrip("}") + f', "timeout_s": {text}}}'
    with pytest.raises(ValueError, match="timeout_s"):
        WeightwireNCCLInitInfo.from_json(body)


def test_nccl_timeout_key_is_unknown_to_stock_backend() -> None:
    # A stock vLLM rejects unknown keys, so the plain nccl info must too.
    with pytest.raises(ValueError, match=r"unknown keys \['timeout_s'\]"):
        NCCLInitInfo.from_dict(nccl_uid(timeout_s=5.0))


def test_nccl_defaults_and_round_trip() -> None:
    info = NCCLInitInfo.from_dict(nccl_uid())
    # vLLM's worker defaults: unpacked, 1 GiB, 2 buffers.
    assert (info.packed, info.packed_buffer_size_bytes, info.packed_num_buffers) == (
        False,
        1 << 30,
        2,
    )
    assert DEFAULT_PACKED_BUFFER_SIZE_BYTES == 1 << 30
    assert info.unique_id_bytes == UID
    # Unused rendezvous fields are dropped, so a stock server only sees one mode.
    assert set(info.to_dict()) == set(UNIQUE_ID_KEYS)
    assert NCCLInitInfo.from_json(info.to_json()) == info
    store = NCCLInitInfo.from_dict(
        nccl_store(packed=True, packed_buffer_size_bytes=4096, packed_num_buffers=3)
    )
    assert store.unique_id_bytes is None and "nccl_unique_id_b64" not in store.to_dict()
    assert NCCLInitInfo.from_json(store.to_json()) == store
    ww = WeightwireNCCLInitInfo.from_dict(nccl_uid(timeout_s=7))
    assert ww.timeout_s == 7 and WeightwireNCCLInitInfo.from_json(ww.to_json()) == ww
    assert WeightwireNCCLInitInfo.from_dict(nccl_uid()).timeout_s == 300.0


# --- TCPInitInfo -----------------------------------------------------------------

TCP_BAD = {
    "missing_host": (without(tcp(), "host"), "missing required field 'host'"),
    "missing_port": (without(tcp(), "port"), "missing required field 'port'"),
    "missing_secret": (without(tcp(), "secret_b64"), "missing required field 'secret_b64'"),
    "unknown_key": (tcp(nccl_unique_id_b64=UID_B64), r"unknown keys \['nccl_unique_id_b64'\]"),
    "secret_127": (tcp(secret_b64=encode_secret(SECRET[:127])), "secret_b64"),
    "secret_url_safe": (tcp(secret_b64=base64.urlsafe_b64encode(UID).decode()), "secret_b64"),
    "secret_non_ascii": (tcp(secret_b64="é" * 172), "secret_b64"),
    "empty_host": (tcp(host=""), "host"),
    "host_with_space": (tcp(host="bad host"), "host"),
    "host_too_long": (tcp(host="a" * 300), "host"),
    "port_zero": (tcp(port=0), "port"),
    "port_bool": (tcp(port=True), "port must be int"),
    "rank_offset_negative": (tcp(rank_offset=-1), "rank_offset"),
    "world_size_str": (tcp(world_size="2"), "world_size must be int"),
    "packed_null": (tcp(packed=None), "packed must be bool"),
    "timeout_zero": (tcp(timeout_s=0.0), "timeout_s"),
    "buffer_float": (tcp(packed_buffer_size_bytes=1.5), "packed_buffer_size_bytes"),
}


@pytest.mark.parametrize("case", sorted(TCP_BAD))
def test_tcp_init_info_rejects(case: str) -> None:
    payload, match = TCP_BAD[case]
    with pytest.raises(ValueError, match=match):
        TCPInitInfo.from_dict(payload)


def test_tcp_defaults_and_round_trip() -> None:
    info = TCPInitInfo.from_dict(tcp())
    assert info.secret == SECRET
    assert (
        info.packed,
        info.packed_buffer_size_bytes,
        info.packed_num_buffers,
        info.timeout_s,
    ) == (
        True,
        64 << 20,
        2,
        300.0,
    )
    assert TCPInitInfo.from_json(info.to_json()) == info
    assert TCPInitInfo.from_json(info.to_json().encode()) == info


# --- secrets never in reprs or error messages ------------------------------------


def test_secrets_redacted_in_repr() -> None:
    for info, secret in [
        (NCCLInitInfo.from_dict(nccl_uid()), UID_B64),
        (WeightwireNCCLInitInfo.from_dict(nccl_uid()), UID_B64),
        (TCPInitInfo.from_dict(tcp()), SECRET_B64),
    ]:
        for text in (repr(info), str(info), f"{info}"):
            assert secret not in text and secret[:16] not in text
            assert "<redacted>" in text
            assert "world_size=" in text  # the rest is still readable


def test_secret_not_echoed_in_errors() -> None:
    short = encode_secret(SECRET[:127])
    with pytest.raises(ValueError) as exc:
        TCPInitInfo.from_dict(tcp(secret_b64=short))
    assert short[:16] not in str(exc.value)
    bad = "-" + UID_B64[1:]
    with pytest.raises(ValueError) as exc:
        NCCLInitInfo.from_dict(nccl_uid(nccl_unique_id_b64=bad))
    assert bad[:16] not in str(exc.value)


# --- field types come from the annotations ---------------------------------------------


def test_field_types_are_read_from_the_annotations() -> None:
    from dataclasses import dataclass, field

    from weightwire.shared.info import StrictInfo, field_kinds

    @dataclass(frozen=True, kw_only=True)
    class Toy(StrictInfo):
        count: int
        label: str | None = None
        items: list[str] = field(default_factory=list)
        seconds: float = 1.0

    assert field_kinds(Toy) == {
        "count": (int,),
        "label": (str,),
        "items": (list,),
        "seconds": (float,),
    }
    assert Toy.from_dict({"count": 2, "label": None, "items": ["a"], "seconds": 3}).seconds == 3
    for body, needle in [
        ({"count": True}, "Toy.count must be int, got bool"),
        ({"count": 1, "label": 5}, "Toy.label must be str, got int"),
        ({"count": 1, "items": "a"}, "Toy.items must be list, got str"),
        ({"count": 1, "seconds": "1"}, "Toy.seconds must be float, got str"),
    ]:
        with pytest.raises(ValueError, match=needle):
            Toy.from_dict(body)


def test_every_init_info_field_has_a_json_type() -> None:
    from weightwire.shared.info import field_kinds

    json_types = {int, float, str, bool, list}
    for cls in (NCCLInitInfo, WeightwireNCCLInitInfo, TCPInitInfo, UpdateInfo):
        kinds = field_kinds(cls)
        assert kinds and all(set(k) <= json_types and len(k) == 1 for k in kinds.values()), (
            cls,
            kinds,
        )
