"""The pytree-kind examples run as scripts (no server): each checks its own mapping
(a named HF tensor equals the slice of the framework's own parameter it must come from)
and prints ``ok``; the add-a-family example checks OLMo-2 against a tiny HF checkpoint."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
KINDS = [
    "nnx_module_source.py",
    "linen_params_source.py",
    "equinox_module_source.py",
    "maxtext_moe_scanned.py",
    "add_a_family.py",
]


@pytest.mark.parametrize("script", KINDS)
def test_example_runs_and_checks_itself(script: str) -> None:
    if script.startswith("equinox") and importlib.util.find_spec("equinox") is None:
        pytest.skip("equinox is not installed")
    if script == "add_a_family.py" and importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed")
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, (
        f"{script} exited {done.returncode}:\n{done.stdout}\n{done.stderr[-3000:]}"
    )
    assert ("ok:" in done.stdout) or ("round-trip bit for bit" in done.stdout), done.stdout
