"""``docs/concepts.md`` names real things: every weightwire name in its tables is exported by
``weightwire`` (one in its prose is, or says its module), every backend it lists is a
registered one, and (given a vLLM source tree in ``WEIGHTWIRE_VLLM_SRC``, as for the interop
lane's framing tests) every vLLM name it maps to is a class or function of that vLLM."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import weightwire
from weightwire import backends

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "concepts.md").read_text()
IDENT = re.compile(r"`([A-Z][A-Za-z0-9]+)[`.(]")


def _table(heading: str) -> list[list[str]]:
    section = DOC.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [
        line
        for line in section.splitlines()
        if line.startswith("| ") and not line.startswith("| ---")
    ]
    return [[cell.strip() for cell in row.strip("|").split(" | ")] for row in rows[1:]]


def test_the_weightwire_names_are_exported() -> None:
    names = {
        name
        for heading, col in (("The pieces", 1), ("weightwire's names and vLLM's", 0))
        for row in _table(heading)
        for name in IDENT.findall(row[col])
    }
    assert {
        "JAXTrainerEngine",
        "TrainerInitInfo",
        "HTTPWeightSyncClient",
        "ModuleSource",
        "ParamMeta",
    } <= names
    assert sorted(n for n in names if not hasattr(weightwire, n)) == []


def test_the_backends_are_the_registered_ones() -> None:
    listed = [re.match(r"`(\w+)`", row[0])[1] for row in _table("Backends")]  # type: ignore[index]
    assert sorted(listed) == sorted(backends.BACKEND_NAMES)


def test_the_vllm_names_exist_in_vllm() -> None:
    src = os.environ.get("WEIGHTWIRE_VLLM_SRC")
    if not src:
        pytest.skip("WEIGHTWIRE_VLLM_SRC names no vLLM source tree")
    names = {
        name for row in _table("weightwire's names and vLLM's") for name in IDENT.findall(row[1])
    }
    assert {
        "WeightTransferTrainerFactory",
        "HTTPVLLMWeightSyncClient",
        "NCCLTrainerInitInfo",
    } <= names
    code = "\n".join(
        p.read_text() for p in (Path(src) / "vllm" / "distributed" / "weight_transfer").glob("*.py")
    )
    defined = set(re.findall(r"^(?:class|def) (\w+)", code, re.M))
    assert sorted(names - defined) == []


def test_every_name_the_page_gives_is_exported_or_says_its_module() -> None:
    # The page opens with "everything below is importable from `weightwire` itself": a name
    # it gives that weightwire does not export says its module right after it.
    ours = DOC.split("## weightwire's names and vLLM's\n", 1)[0]  # that table: both sides' names
    unexported = sorted(
        {
            m[1]
            for m in re.finditer(r"`([A-Z][A-Za-z0-9]+)[`.(]([^\n]{0,20})", ours)
            if not hasattr(weightwire, m[1])
            and m[1] != "Engine"  # `Engine.trainer_init(...)`: either engine
            and not re.match(r"` \(`weightwire\.", "`" + m[2])
        }
    )
    assert unexported == [], f"export these, or give their module: {unexported}"
