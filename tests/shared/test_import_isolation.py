"""What importing a package loads, checked at run time in fresh interpreters (this test
process may already hold jax and torch).

The static rules are in ``test_import_graph.py``; these confirm them where it counts:
``import weightwire`` loads no framework (nor httpx, nor numpy), ``weightwire.shared``
neither jax nor torch nor cupy, the torch side never jax (nor vLLM, nor cupy), and the
public names of one side never load the other's framework.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

WATCHED = (
    "jax",
    "jaxlib",
    "flax",
    "torch",
    "cupy",
    "vllm",
    "transformers",
    "httpx",
    "numpy",
    "ray",
)

PROBE = """
import json, sys
{imports}
print(json.dumps(sorted({{m.split(".")[0] for m in sys.modules}} & set({watched!r}))))
"""


def loaded(imports: str) -> set[str]:
    """The watched top-level modules that ``imports`` loads in a fresh interpreter."""
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(imports=imports, watched=WATCHED)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_import_weightwire_loads_nothing_heavy() -> None:
    # dir() lists the public names without resolving any of them.
    got = loaded(
        "import weightwire\nassert {'JAXTrainerEngine', 'TrainerInitInfo'} <= set(dir(weightwire))"
    )
    assert got == set(), got


def test_shared_imports_no_framework() -> None:
    got = loaded(
        "import weightwire.shared\n"
        "import weightwire.shared.communicator, weightwire.shared.framing, "
        "weightwire.shared.groups\n"
        "import weightwire.shared.info, weightwire.shared.routes\n"
        "import weightwire.shared.source, weightwire.shared.timeouts, weightwire.shared.version\n"
        # Each backend's init info is parsed on both sides: numpy-only like the contract.
        "import weightwire.backends.tcp.info, weightwire.backends.nccl.info, "
        "weightwire.backends.ipc.info"
    )
    assert "numpy" in got and not got & {"jax", "jaxlib", "flax", "torch", "cupy"}, got


def test_torch_side_packages_are_light() -> None:
    got = loaded(
        "import weightwire.torch_side, weightwire.torch_side.worker, "
        "weightwire.torch_side.worker.plugin"
    )
    assert got == set(), got


@pytest.mark.parametrize(
    "what",
    [
        (
            "from weightwire.torch_side import ModuleSource, HFModelHost, "
            "WeightwireTCPEngine, WeightwireNCCLEngine"
        ),
        "from weightwire.torch_side import TorchTrainerEngine",
        "from weightwire.torch_side.worker import register; register()",
        (
            "import weightwire.torch_side.worker.connect, weightwire.torch_side.worker.core, "
            "weightwire.torch_side.worker.receive"
        ),
        (
            "import weightwire.backends.tcp.worker, weightwire.backends.nccl.worker, "
            "weightwire.backends.ipc.worker"
        ),
        "from weightwire import TorchTrainerEngine, ModuleSource",
    ],
)
def test_torch_side_never_loads_jax(what: str) -> None:
    got = loaded(what)
    assert not got & {"jax", "jaxlib", "flax", "vllm", "cupy"}, got


def test_jax_names_never_load_torch() -> None:
    got = loaded("from weightwire import JAXTrainerEngine, PytreeSource, preset, load_decoder")
    assert "jax" in got and not got & {"torch", "cupy", "vllm"}, got


def test_trainer_and_client_names_load_no_framework() -> None:
    got = loaded(
        "from weightwire import TrainerInitInfo, HTTPWeightSyncClient, RoundMetrics, TCPInitInfo"
    )
    assert "httpx" in got and not got & {"jax", "jaxlib", "flax", "torch", "cupy"}, got
