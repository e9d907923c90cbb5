"""The worked example of docs/wire-format.md §5/§6, number for number; its §8 version gates
are the code's.

The numbers are copied from the document (not parsed from it): if the code or the
document changes, this file is the place where the two must be made to agree again.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from weightwire.shared import WIRE_DTYPES, UpdateInfo, plan_packed, plan_unpacked
from weightwire.shared.version import FEATURES

DOC = (Path(__file__).resolve().parents[2] / "docs" / "wire-format.md").read_text()

EXAMPLE = {
    "names": [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.norm.weight",
    ],
    "dtype_names": ["bfloat16", "bfloat16", "float32"],
    "shapes": [[1000, 64], [64, 64], [64]],
}

# buffer size -> [(tensors, size, offsets in chunk, [stream start, stream end))]
DOC_CHUNKS = {
    131072: [((0, 1), 136192, (0, 128000), (0, 136192)), ((2,), 256, (0,), (136192, 136448))],
    65536: [((0,), 128000, (0,), (0, 128000)), ((1, 2), 8448, (0, 8192), (128000, 136448))],
    128000: [((0, 1), 136192, (0, 128000), (0, 136192)), ((2,), 256, (0,), (136192, 136448))],
}


def test_example_tensor_sizes() -> None:
    metas = UpdateInfo.from_dict(EXAMPLE).metas()
    assert [m.nbytes for m in metas] == [128000, 8192, 256]
    assert sum(m.nbytes for m in metas) == 136448


@pytest.mark.parametrize("buffer_size", sorted(DOC_CHUNKS))
def test_example_packed_chunks(buffer_size: int) -> None:
    metas = UpdateInfo.from_dict(EXAMPLE).metas()
    got = []
    stream = 0
    for c in plan_packed(metas, buffer_size):
        got.append(
            (tuple(range(c.start, c.stop)), c.nbytes, c.offsets, (stream, stream + c.nbytes))
        )
        stream += c.nbytes
    assert got == DOC_CHUNKS[buffer_size]


def test_example_unpacked() -> None:
    metas = UpdateInfo.from_dict(EXAMPLE).metas()
    assert [c.nbytes for c in plan_unpacked(metas)] == [128000, 8192, 256]
    assert [m.numel for m in metas] == [64000, 4096, 64]
    # NCCL dtype enums of the doc's table: bfloat16 9, float32 7.
    assert [WIRE_DTYPES[m.dtype].nccl for m in metas] == [9, 9, 7]


def test_doc_dtype_table_nccl_column() -> None:
    assert {n: r.nccl for n, r in WIRE_DTYPES.items()} == {
        "bfloat16": 9,
        "float16": 6,
        "float32": 7,
        "float64": 8,
        "int8": 0,
        "uint8": 1,
        "int32": 2,
        "int64": 4,
        "float8_e4m3fn": 1,
        "float8_e5m2": 1,
        "bool": 1,
    }


def test_the_version_gates_table_is_the_codes() -> None:
    # §8 says weightwire "decides from this table": each gate of shared/version.py, at its
    # first version, and "not assumed of releases newer" exactly where it does not carry forward.
    section = DOC.split("## 8. Version gates", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (\d+)\.(\d+) \| `(\w+)` \| (.*) \|$", section, re.M)
    documented = {
        name: ((int(major), int(minor)), "not assumed of releases newer" not in what)
        for major, minor, name, what in rows
    }
    assert len(documented) == len(rows), "a gate listed twice"
    assert documented == {f.name: (f.first, f.carries_forward) for f in FEATURES}
