"""The worker's round (``core._ReceiverCore.receive``): a dense round runs no delta or adapter
code, and the steps ``docs/architecture.md`` lists ("One worker round") are the function's.

The dense round runs in a fresh interpreter whose delta / adapter modules are poisoned before
anything imports them: a module object whose every attribute access is recorded and raises, so
an import (``from ... import X``) or a call on any path of the round fails it.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "weightwire" / "torch_side" / "worker" / "core.py"
DOC = (ROOT / "docs" / "architecture.md").read_text()

POISONED = [
    "weightwire.torch_side.worker.delta",
    "weightwire.torch_side.worker.sinks",
    "weightwire.torch_side.worker.lora",
    "weightwire.torch_side.worker.vllm_lora",
]

# Dense rounds through the standalone TCP engine over the reference server's host
# (``HFModelHost``) and through vLLM's plugin engine class over a vLLM-laid-out model
# (``vllm_stub``: its layerwise reload, the loader-map recorder): each staged, then streaming.
_SCRIPT = r"""
import json, sys, types

touched = []

class Poisoned(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        touched.append(f"{self.__name__}.{name}")
        raise AssertionError(f"a dense round touched {self.__name__}.{name}")

for name in json.loads(sys.argv[1]):
    sys.modules[name] = Poisoned(name)

import torch
from tests.torch_side.fake_llama import digest, trainer_tensors
from tests.torch_side.test_engine_rules import ThreadSender, Tiny, make_engine, send_module
from tests.torch_side.vllm_stub import _engine_class, make_model, model_digests
from weightwire.shared.framing import pack_host, plan
from weightwire.shared.meta import ParamMeta
from weightwire.shared.update_info import UpdateInfo
from weightwire.torch_side.sender.source import ModuleSource

CPU = torch.device("cpu")
BUDGETS = (1 << 30, 0)
out = {"strategies": [], "equal": []}


def round_(engine, sender, budget, metas):
    engine.init_transfer_engine(sender.info(stage_budget_bytes=budget).to_dict())
    engine.start_weight_update()
    engine.update_weights(UpdateInfo.from_metas(metas).to_dict())
    out["strategies"].append(engine._core.strategy)
    engine.finish_weight_update()
    sender.join()
    assert sender.error is None, sender.error


for budget in BUDGETS:  # the reference server's host
    trainer = Tiny(seed=budget % 7 + 1)
    engine, host = make_engine()
    round_(engine, ThreadSender(send_module(trainer)), budget, ModuleSource(trainer).metadata())
    out["equal"].append(
        all(torch.equal(host.model.get_parameter(n), p) for n, p in trainer.named_parameters())
    )
    engine.shutdown()

tensors = list(trainer_tensors("tiny", CPU, 3))
metas = [ParamMeta(n, "bfloat16", tuple(t.shape)) for n, t in tensors]
arrays = [t.view(torch.int16).numpy() for _, t in tensors]  # the same bytes


def send_llama(comm):
    for chunk in plan(metas, packed=True, buffer_size_bytes=256):
        comm.broadcast(pack_host(arrays[chunk.start : chunk.stop], chunk), timeout=20)


vllm_config = types.SimpleNamespace(
    model_config=types.SimpleNamespace(model=None, dtype=torch.bfloat16),
    parallel_config=types.SimpleNamespace(data_parallel_index=0, world_size=1, rank=0),
)
for budget in BUDGETS:  # vLLM's plugin engine class
    model = make_model("llama", "tiny", CPU)
    engine = _engine_class("weightwire_tcp", "weightwire")(None, vllm_config, CPU, model)
    round_(engine, ThreadSender(send_llama), budget, metas)
    out["equal"].append(model_digests(model, "llama") == {n: digest(t) for n, t in tensors})
    engine.shutdown()

out["touched"] = touched
out["still_poisoned"] = [n for n in json.loads(sys.argv[1]) if isinstance(sys.modules[n], Poisoned)]
print("RESULT " + json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_a_dense_round_runs_no_delta_or_adapter_code() -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT, json.dumps(POISONED)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    out = json.loads(lines[-1].removeprefix("RESULT "))
    assert out["touched"] == []
    assert out["strategies"] == ["staged", "streaming"] * 2
    assert out["equal"] == [True] * 4  # every round committed the trainer's bytes
    assert out["still_poisoned"] == POISONED  # nothing imported the real modules instead


def _doc_steps() -> list[str]:
    """The numbered steps of the "One worker round" section, as written."""
    section = DOC[DOC.index("## One worker round") :]
    section = section[: section.find("\n## ", 1)] if "\n## " in section[1:] else section
    return re.findall(r"^\d+\. `([\w.]+)`", section, flags=re.M)


def _receive_steps() -> list[str]:
    """The calls of ``_ReceiverCore.receive`` inside its ``try`` blocks (the round's steps),
    in source order, as ``self.``-relative names (``_link.receive``)."""
    tree = ast.parse(CORE.read_text())
    core = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "_ReceiverCore")
    receive = next(n for n in core.body if isinstance(n, ast.FunctionDef) and n.name == "receive")
    steps: list[tuple[int, int, str]] = []
    for block in (n for n in receive.body if isinstance(n, ast.Try)):
        for node in ast.walk(ast.Module(body=block.body, type_ignores=[])):
            if not isinstance(node, ast.Call):
                continue
            parts: list[str] = []
            func: ast.expr = node.func
            while isinstance(func, ast.Attribute):
                parts.insert(0, func.attr)
                func = func.value
            if isinstance(func, ast.Name) and func.id == "self" and parts:
                steps.append((node.lineno, node.col_offset, ".".join(parts)))
    return [name for _, _, name in sorted(steps)]


def test_the_doc_lists_the_worker_rounds_steps_in_order() -> None:
    assert _receive_steps() == _doc_steps()
    assert len(_doc_steps()) >= 10
