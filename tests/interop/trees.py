"""Which vLLM trees the in-process interop checks read vLLM's own files from: the interop
venv's vLLM always, and a source tree too when ``WEIGHTWIRE_VLLM_SRC`` names one."""

from __future__ import annotations

import glob
import os

import pytest


def vllm_trees() -> list[str]:
    """``"venv"``, then ``"src"`` when ``WEIGHTWIRE_VLLM_SRC`` names a tree (a fixture's params)."""
    return ["venv"] + (["src"] if os.environ.get("WEIGHTWIRE_VLLM_SRC") else [])


def vllm_tree_root(kind: str, needs: str) -> str:
    """The directory holding the ``vllm`` package of tree ``kind``; for the venv, its
    site-packages whose vLLM has ``needs`` (a path inside the package), else the test skips."""
    if kind == "src":
        return os.environ["WEIGHTWIRE_VLLM_SRC"]
    venv = os.environ.get("WEIGHTWIRE_INTEROP_VENV")
    if not venv:
        pytest.skip(
            "no interop venv: run tests/interop/run.sh (it exports WEIGHTWIRE_INTEROP_VENV)"
        )
    found = [
        p
        for p in sorted(glob.glob(os.path.join(venv, "lib", "python*", "site-packages")))
        if os.path.exists(os.path.join(p, "vllm", needs))
    ]
    if not found:
        pytest.skip(f"{venv} holds no vllm/{needs}")
    return found[0]
