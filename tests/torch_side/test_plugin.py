"""The vLLM plugin: harmless without vLLM, idempotent with a duplicate-refusing factory,
and (interop lane) resolving to our engines inside a real vLLM."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import types
from importlib.metadata import entry_points

import pytest

from weightwire import backends
from weightwire.torch_side.worker import plugin

VLLM_PYTHON = os.environ.get("WEIGHTWIRE_VLLM_PYTHON", "/work/vllm_venv/bin/python")
CHECK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "interop", "check_plugin.py")


def _result(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("WEIGHTWIRE_CHECK ")]
    assert lines, f"no result line in: {stdout[-2000:]}"
    return json.loads(lines[-1].removeprefix("WEIGHTWIRE_CHECK "))


def test_entry_point_is_declared():
    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "weightwire"]
    assert ep.value == "weightwire.torch_side.worker.plugin:register"
    assert ep.load() is plugin.register


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_register_without_vllm_is_quiet(caplog):
    with caplog.at_level(logging.DEBUG, logger="weightwire.torch_side.worker.plugin"):
        assert plugin.register() is None
        assert plugin.register() is None
    assert all(r.levelno == logging.DEBUG for r in caplog.records)
    assert "nothing registered" in caplog.text
    assert "vllm" not in sys.modules


class FakeFactory:
    """Mimics vLLM 0.32/0.33: lazy registration by module path, ValueError on a duplicate."""

    registry: dict[str, tuple[str, str]] = {}

    @classmethod
    def register_engine(cls, name, module_path_or_cls, class_name=None):
        if name in cls.registry:
            raise ValueError(f"Weight transfer engine '{name}' is already registered.")
        cls.registry[name] = (module_path_or_cls, class_name)


def test_register_is_lazy_and_idempotent(monkeypatch):
    for mod in ("vllm", "vllm.distributed", "vllm.distributed.weight_transfer"):
        monkeypatch.setitem(sys.modules, mod, types.ModuleType(mod))
    factory_mod = types.ModuleType("vllm.distributed.weight_transfer.factory")
    factory_mod.WeightTransferEngineFactory = FakeFactory  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm.distributed.weight_transfer.factory", factory_mod)
    monkeypatch.setattr(FakeFactory, "registry", {"nccl": ("vllm.x", "NCCLWeightTransferEngine")})
    plugin.register()
    plugin.register()  # vLLM may load plugins twice in one process
    assert FakeFactory.registry == {
        "nccl": ("vllm.x", "NCCLWeightTransferEngine"),
        "weightwire_tcp": ("weightwire.torch_side.worker.vllm_engines", "VllmWeightwireTCPEngine"),
        "weightwire_nccl": ("weightwire.torch_side.worker.vllm_engines", "VllmWeightwireNCCLEngine"),
        "weightwire_ipc": ("weightwire.torch_side.worker.vllm_engines", "VllmWeightwireIPCEngine"),
    }
    assert "weightwire.torch_side.worker.vllm_engines" not in sys.modules, "registration must not import the engines"


@pytest.mark.interop
@pytest.mark.timeout(300)
@pytest.mark.skipif(not os.path.exists(VLLM_PYTHON), reason=f"no vLLM interpreter at {VLLM_PYTHON}")
def test_plugin_and_tcp_engine_inside_real_vllm():
    proc = subprocess.run([VLLM_PYTHON, CHECK], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = _result(proc.stdout)
    assert result["ok"] and result["rounds"] == 2
    assert set(result["resolved"]) == set(backends.PLUGIN_BACKENDS)


@pytest.mark.interop
@pytest.mark.timeout(600)
@pytest.mark.skipif(not os.path.exists(VLLM_PYTHON), reason=f"no vLLM interpreter at {VLLM_PYTHON}")
def test_weights_pushed_into_offline_vllm_generate_like_hf(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1", TMPDIR=str(tmp_path),
               VLLM_CACHE_ROOT=str(tmp_path / "vllm"), XDG_CACHE_HOME=str(tmp_path / "xdg"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), WEIGHTWIRE_CACHE=str(tmp_path / "ww"))
    proc = subprocess.run([VLLM_PYTHON, CHECK, "--llm"], capture_output=True, text=True, timeout=540, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _result(proc.stdout)["llm_ok"]
