"""UpdateInfo and ParamMeta: every malformed payload is refused with a ``ValueError`` naming
the field, and valid ones round-trip through JSON. (The init infos: ``test_info.py``.)"""

from __future__ import annotations

import json

import pytest

from weightwire import NCCLInitInfo, TCPInitInfo, WeightwireNCCLInitInfo
from weightwire.shared import ParamMeta, UpdateInfo
from weightwire.shared.delta import Patch
from weightwire.shared.errors import ConfigError


def update(**over: object) -> dict:
    base = {"names": ["a", "b"], "dtype_names": ["bfloat16", "float32"], "shapes": [[2, 3], []]}
    return {**base, **over}


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


# --- a sliced delta round's shares --------------------------------------------------


def sliced_delta(**over: object) -> dict:
    base = {
        "names": ["w@index", "w@values"],
        "dtype_names": ["int32", "float32"],
        "shapes": [[3], [3]],
        "round_token": "s:2",
        "delta_base": "s:1",
        "patches": [["w", "float32", [4, 2], 3, "flat_i32"]],
        "sliced": True,
        "shares": [[1], [3]],
    }
    return {**base, **over}


def test_shares_round_trip_and_name_each_workers_share() -> None:
    info = UpdateInfo.from_dict(json.loads(json.dumps(sliced_delta())))
    assert info.to_dict()["shares"] == [[1], [3]]
    assert info.share(0) == [1] and info.share(1) == [3]
    assert "shares" not in UpdateInfo.from_dict(update()).to_dict()
    with pytest.raises(ValueError, match=r"shares name 2 worker\(s\), none for worker 2"):
        info.share(2)


@pytest.mark.parametrize(
    ("over", "match"),
    [
        (
            {"shares": [[4], [0]]},
            r"shares\[0\] must list, per patch, an int count in \[0, its nnz\]",
        ),
        ({"shares": [[1, 1]]}, r"shares\[0\] must list, per patch"),
        ({"shares": [[True]]}, r"shares\[0\] must list, per patch"),
        ({"shares": [[-1]]}, r"shares\[0\] must list, per patch"),
        ({"shares": []}, "shares must be a list of 1 to"),
        ({"sliced": False}, "shares are a sliced delta round's: they need sliced and patches"),
    ],
    ids=["over-nnz", "two-counts-one-patch", "bool", "negative", "no-worker", "not-sliced"],
)
def test_malformed_shares_are_refused_naming_the_field(over: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        UpdateInfo.from_dict(sliced_delta(**over))


def test_a_delta_updates_patches_are_checked_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The patch list is validated when the info is made (parsed or built) and kept: a
    delta round's hundreds of entries are not checked again per reader."""
    import weightwire.shared.update_info as update_info

    calls = []
    real = update_info.check_patches
    monkeypatch.setattr(
        update_info, "check_patches", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    info = UpdateInfo(
        names=["w@index", "w@values"],
        dtype_names=["int32", "bfloat16"],
        shapes=[[2], [2]],
        round_token="s:2",
        delta_base="s:1",
        patches=[["w", "bfloat16", [4], 2, "flat_i32"]],
    )
    parsed = UpdateInfo.from_dict(info.to_dict())
    assert len(calls) == 2  # each made once
    assert parsed.patch_list() == info.patch_list() == [Patch("w", "bfloat16", (4,), 2)]
    assert len(calls) == 2
    with pytest.raises(ConfigError, match="must list 'w@index' then 'w@values'"):
        UpdateInfo.from_dict({**info.to_dict(), "names": ["w@values", "w@index"]})
