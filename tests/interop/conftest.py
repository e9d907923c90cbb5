"""Fixtures of the interop lane: a real vLLM started by ``tests/interop/run.sh``.

``run.sh`` exports ``WEIGHTWIRE_INTEROP_URL`` (the server) and
``WEIGHTWIRE_INTEROP_MODEL_DIR`` (the tiny Llama it serves); without them every test
here skips, naming the script. The server is shared by the whole session, so tests
that change its weights put the original weights back before they end.
"""

from __future__ import annotations

import os

import pytest

from tests.interop.helpers import VLLMServer


@pytest.fixture(scope="session")
def vllm_server() -> VLLMServer:
    url, model_dir = os.environ.get("WEIGHTWIRE_INTEROP_URL"), os.environ.get("WEIGHTWIRE_INTEROP_MODEL_DIR")
    if not url or not model_dir:
        pytest.skip("no real vLLM: run tests/interop/run.sh (it starts one and sets WEIGHTWIRE_INTEROP_URL)")
    return VLLMServer(url.rstrip("/"), model_dir)
