"""Init / update info and ParamMeta: every malformed payload is refused with a
``ValueError`` naming the field, valid ones round-trip through JSON, secrets never
reach a repr."""

from __future__ import annotations

import base64
import json

import pytest

from weightwire.shared import (
    NCCLInitInfo,
    ParamMeta,
    TCPInitInfo,
    UpdateInfo,
    WeightwireNCCLInitInfo,
)
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


def update(**over: object) -> dict:
    base = {"names": ["a", "b"], "dtype_names": ["bfloat16", "float32"], "shapes": [[2, 3], []]}
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
    assert set(info.to_dict()) == {
        "nccl_unique_id_b64",
        "rank_offset",
        "world_size",
        "packed",
        "packed_buffer_size_bytes",
        "packed_num_buffers",
    }
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


# --- UpdateInfo --------------------------------------------------------------------

UPDATE_BAD = {
    "unknown_key": (update(packed=True), r"unknown keys \['packed'\]"),
    "dtype_names_short": (
        update(dtype_names=["float32"]),
        "dtype_names has 1 entries but names has 2",
    ),
    "shapes_long": (update(shapes=[[1], [2], [3]]), "shapes has 3 entries but names has 2"),
    "names_only": ({"names": ["a"]}, "dtype_names has 0 entries"),
    "negative_dim": (update(shapes=[[2, -3], []]), r"shapes\[0\] has a negative dim -3"),
    "bool_dim": (update(shapes=[[True], []]), r"shapes\[0\] has a non-integer dim True"),
    "float_dim": (update(shapes=[[], [2.0]]), r"shapes\[1\] has a non-integer dim 2.0"),
    "shape_not_list": (update(shapes=[5, []]), r"shapes\[0\] must be a list"),
    "rank_17": (update(shapes=[[1] * 17, []]), r"shapes\[0\] has 17 dims"),
    # float32 [2^31, 2^31, 2^31] = 2^93 x 4 bytes: past int64, refused before any math in C.
    "int64_overflow": (update(shapes=[[2**31] * 3, []]), r"shapes\[0\]"),
    "huge_dim": (update(shapes=[[2**70], []]), r"shapes\[0\] has dim"),
    "unknown_dtype": (
        update(dtype_names=["bfloat16", "complex64"]),
        r"dtype_names\[1\]: unsupported dtype 'complex64'",
    ),
    "dtype_torch_prefix": (update(dtype_names=["torch.bfloat16", "float32"]), r"dtype_names\[0\]"),
    "dtype_not_str": (update(dtype_names=[7, "float32"]), r"dtype_names\[0\]"),
    "empty_name": (update(names=["", "b"]), r"names\[0\]"),
    "name_not_str": (update(names=["a", 3]), r"names\[1\]"),
    "name_too_long": (update(names=["a", "x" * 1025]), r"names\[1\]"),
    "duplicate_name": (update(names=["a", "a"]), "names lists 'a' more than once"),
    "names_not_list": (update(names="ab"), "names must be list"),
    "shapes_null": (update(shapes=None), "shapes must be list"),
    "not_object": ("names", "must be a JSON object"),
}


@pytest.mark.parametrize("case", sorted(UPDATE_BAD))
def test_update_info_rejects(case: str) -> None:
    payload, match = UPDATE_BAD[case]
    with pytest.raises(ValueError, match=match):
        UpdateInfo.from_dict(payload)
    with pytest.raises(ValueError, match=match):
        UpdateInfo.from_json(json.dumps(payload))


@pytest.mark.parametrize(
    "text", ["", "{", "not json", "{'names': []}", b"\xff\xfe\xfa", "[" * 50_000, "{}x"]
)
def test_non_json_text_is_refused(text: str | bytes) -> None:
    for cls in (UpdateInfo, NCCLInitInfo, WeightwireNCCLInitInfo, TCPInitInfo, ParamMeta):
        with pytest.raises(ValueError, match=f"{cls.__name__}: body is not valid JSON"):
            cls.from_json(text)


def test_non_text_body_is_refused() -> None:
    with pytest.raises(ValueError, match="body must be JSON text"):
        UpdateInfo.from_json(5)  # type: ignore[arg-type]


def test_update_info_round_trip_and_metas() -> None:
    info = UpdateInfo.from_dict(update())
    assert UpdateInfo.from_json(info.to_json()) == info
    ms = info.metas()
    assert [(m.name, m.dtype, m.shape, m.nbytes) for m in ms] == [
        ("a", "bfloat16", (2, 3), 12),
        ("b", "float32", (), 4),
    ]
    assert UpdateInfo.from_metas(ms) == info
    assert not info.reuses_previous
    assert repr(info) == "UpdateInfo(2 tensors)"


def test_update_info_empty_means_reuse() -> None:
    for payload in ({}, {"names": [], "dtype_names": [], "shapes": []}):
        info = UpdateInfo.from_dict(payload)
        assert info.reuses_previous and info.metas() == []


# --- ParamMeta ------------------------------------------------------------------


def test_param_meta_round_trip() -> None:
    for meta in [
        ParamMeta("model.embed_tokens.weight", "bfloat16", (512, 64)),
        ParamMeta("scale", "float32", ()),
        ParamMeta("model.layers.0.mlp.experts.3.w1", "float8_e4m3fn", (0, 4), owners=(0, 2)),
    ]:
        assert ParamMeta.from_json(meta.to_json()) == meta
        assert ParamMeta.from_dict(json.loads(meta.to_json())) == meta
    assert ParamMeta.from_dict({"name": "x", "dtype": "int8", "shape": [2, 3]}).shape == (2, 3)
    assert ParamMeta("x", "int64", (2, 3)).nbytes == 48  # 6 elements x 8 bytes


PARAM_BAD = {
    "missing_shape": ({"name": "x", "dtype": "int8"}, "missing required field 'shape'"),
    "missing_name": ({"dtype": "int8", "shape": []}, "missing required field 'name'"),
    "unknown_key": (
        {"name": "x", "dtype": "int8", "shape": [], "stride": [1]},
        r"unknown keys \['stride'\]",
    ),
    "unknown_dtype": (
        {"name": "x", "dtype": "int4", "shape": []},
        "dtype of 'x': unsupported dtype 'int4'",
    ),
    "negative_dim": (
        {"name": "x", "dtype": "int8", "shape": [-1]},
        "shape of 'x' has a negative dim",
    ),
    "overflow": ({"name": "x", "dtype": "float64", "shape": [2**31] * 3}, "shape of 'x'"),
    "empty_name": ({"name": "", "dtype": "int8", "shape": []}, "ParamMeta.name"),
    "owners_not_list": (
        {"name": "x", "dtype": "int8", "shape": [], "owners": 0},
        "ParamMeta.owners",
    ),
    "owners_bool": ({"name": "x", "dtype": "int8", "shape": [], "owners": [True]}, "owners of 'x'"),
    "owners_empty": ({"name": "x", "dtype": "int8", "shape": [], "owners": []}, "owners of 'x'"),
    "owners_negative": (
        {"name": "x", "dtype": "int8", "shape": [], "owners": [-1]},
        "owners of 'x'",
    ),
    "not_object": (["x", "int8", []], "ParamMeta must be a JSON object"),
}


@pytest.mark.parametrize("case", sorted(PARAM_BAD))
def test_param_meta_rejects(case: str) -> None:
    payload, match = PARAM_BAD[case]
    with pytest.raises(ValueError, match=match):
        ParamMeta.from_dict(payload)
    with pytest.raises(ValueError, match=match):
        ParamMeta.from_json(json.dumps(payload))


def test_param_meta_rejects_non_string_keys() -> None:
    # Only reachable from Python (JSON keys are strings), and must not be a TypeError.
    with pytest.raises(ValueError, match=r"unknown keys \[1\]"):
        ParamMeta.from_dict({1: 2, "name": "x", "dtype": "int8", "shape": []})


# --- field types come from the annotations ---------------------------------------------


def test_field_types_are_read_from_the_annotations() -> None:
    from dataclasses import dataclass, field

    from weightwire.shared.info import _StrictInfo, field_kinds

    @dataclass(frozen=True, kw_only=True)
    class Toy(_StrictInfo):
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
