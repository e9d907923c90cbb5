"""The plugin inside a real vLLM (the interop venv), without a server: one process of
``check_plugin.py --all``.

It resolves both backend names through vLLM's ``WeightTransferEngineFactory``, runs a
``weightwire_tcp`` session through the vLLM engine subclass byte for byte, then starts
an offline ``vllm.LLM`` with ``weight_transfer_config={"backend": "weightwire_tcp"}``
and pushes another seed's weights in two packed rounds: greedy tokens must equal
Hugging Face's before and after. (The unit half of the plugin's tests, which needs no
vLLM, is ``tests/torch_side/test_plugin.py``.)

The offline engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: no engine
core or worker process to start, ~25 s less) and reads the lane's warmed model-info
cache; the server tests cover vLLM's multi-process paths.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.interop.launcher import Launcher, prefixed_json
from weightwire import backends

pytestmark = [pytest.mark.interop, pytest.mark.timeout(600)]

CHECK = Path(__file__).with_name("check_plugin.py")
PREFIX = "WEIGHTWIRE_CHECK "


@pytest.fixture(scope="module")
def checked(launcher: Launcher, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Both result lines of one ``check_plugin.py --all`` run, merged."""
    tmp = tmp_path_factory.mktemp("plugin")
    proc = launcher.run_offline(
        CHECK, ["--all"], tmp, extra_env={"WEIGHTWIRE_CACHE": str(tmp / "ww")}
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = prefixed_json(proc.stdout, PREFIX)
    assert len(results) == 2, (
        f"expected 2 result lines, got {len(results)} in: {proc.stdout[-2000:]}"
    )
    return {k: v for result in results for k, v in result.items()}


def test_plugin_and_tcp_engine_inside_real_vllm(checked: dict) -> None:
    assert checked["ok"] and checked["rounds"] == 2
    assert set(checked["resolved"]) == set(backends.PLUGIN_BACKENDS)


def test_weights_pushed_into_offline_vllm_generate_like_hf(checked: dict) -> None:
    assert checked["llm_ok"]
    assert len(checked["tokens_after"]) == 12
