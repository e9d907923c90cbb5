"""``weightwire.shared`` is the contract a torch-free JAX host and a jax-free vLLM
worker both import: loading it must pull in neither framework (nor cupy)."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = ("jax", "jaxlib", "torch", "cupy", "flax")

_PROBE = """
import json, sys
import weightwire.shared
import weightwire.shared.communicator, weightwire.shared.framing, weightwire.shared.groups
import weightwire.shared.info, weightwire.shared.routes, weightwire.shared.source
import weightwire.shared.timeouts, weightwire.shared.version
print(json.dumps(sorted(sys.modules)))
"""


def test_shared_imports_no_framework() -> None:
    # A fresh interpreter: this test process may already have jax/torch loaded.
    proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "weightwire.shared" in loaded and "numpy" in loaded
    leaked = [mod for mod in loaded if mod.split(".")[0] in FORBIDDEN]
    assert leaked == []
