"""``import weightwire.torch_side`` never loads jax (nor vLLM, nor cupy), checked in fresh interpreters."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PROBE = """
import json, sys
{imports}
print(json.dumps({{m: m in sys.modules for m in ("jax", "jaxlib", "flax", "vllm", "cupy", "torch", "transformers")}}))
"""


def _loaded(imports: str) -> dict[str, bool]:
    out = subprocess.run([sys.executable, "-c", PROBE.format(imports=imports)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_package_import_is_light():
    loaded = _loaded("import weightwire.torch_side, weightwire.torch_side.worker, weightwire.torch_side.worker.plugin")
    assert loaded == {m: False for m in loaded}, loaded


@pytest.mark.parametrize("what", [
    "from weightwire.torch_side import ModuleSource, HFModelHost, WeightwireTCPEngine, WeightwireNCCLEngine",
    "from weightwire.torch_side import TorchTrainerEngine",
    "from weightwire.torch_side.worker import register; register()",
    "import weightwire.torch_side.worker.connect, weightwire.torch_side.worker.core, weightwire.torch_side.worker.receive",
    "import weightwire.backends.tcp.worker, weightwire.backends.nccl.worker, weightwire.backends.ipc.worker",
])
def test_torch_side_modules_never_load_jax(what):
    loaded = _loaded(what)
    assert not any(loaded[m] for m in ("jax", "jaxlib", "flax", "vllm", "cupy")), loaded
