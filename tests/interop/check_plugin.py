"""Check, inside a real vLLM install, that the weightwire plugin and worker engines work.

Run with the vLLM environment's interpreter (weightwire installed there, e.g.
``pip install --no-deps -e .`` plus ``ml_dtypes``)::

    /path/to/vllm-venv/bin/python tests/interop/check_plugin.py

It loads vLLM's general plugins (twice: vLLM may), resolves both backend names
through ``WeightTransferEngineFactory``, constructs each engine the way a vLLM worker
does (``create_engine(config, vllm_config, device, model)``), then runs a real
``weightwire_tcp`` session on CPU through the vLLM subclass: init, two rounds (the
second with the 0.33 reuse shorthand), finish, shutdown. Prints one
``WEIGHTWIRE_CHECK {json}`` line and exits 0 on success; any failed check raises.

``--llm`` instead starts an offline ``vllm.LLM`` on a tiny Llama with
``weight_transfer_config={"backend": "weightwire_tcp"}``, pushes another seed's
weights in two packed rounds (multi-chunk; the second reuses the metadata) through
vLLM's layerwise reload, and checks greedy tokens equal Hugging Face's before and
after. Set ``HF_HUB_OFFLINE=1``, ``VLLM_CPU_KVCACHE_SPACE=1`` and scratch cache dirs.
``--all`` runs both in one process (one vLLM import instead of two: the interop lane's
way) and prints both result lines.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from types import SimpleNamespace

import numpy as np
import torch


class Recorder(torch.nn.Module):
    """A model without parameters (so vLLM's layerwise reload has nothing to move) that
    records what load_weights received."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights):
        for name, tensor in weights:
            self.loaded[name] = tensor.clone()
        return set(self.loaded)


def main() -> None:
    import vllm
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins

    from weightwire.backends.tcp.rendezvous import TCPRendezvous
    from weightwire.shared.framing import pack_host, plan
    from weightwire.shared.meta import ParamMeta
    from weightwire.shared.update_info import UpdateInfo
    from weightwire.torch_side.worker import plugin

    load_general_plugins()
    plugin.register()  # a second registration must be a quiet no-op
    resolved = {}
    for name, (module, class_name) in plugin.engines().items():
        cls = WeightTransferEngineFactory._registry[name]()
        assert cls.__name__ == class_name and cls.__module__ == module, cls
        assert issubclass(cls, WeightTransferEngine)
        resolved[name] = f"{cls.__module__}.{cls.__name__}"

    vllm_config = SimpleNamespace(
        parallel_config=SimpleNamespace(rank=0, world_size=1, data_parallel_index=0),
        model_config=SimpleNamespace(dtype=torch.float32),
    )
    nccl_engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="weightwire_nccl"),
        vllm_config,
        torch.device("cpu"),
        Recorder(),
    )
    try:
        nccl_engine.parse_init_info({"rank_offset": 1, "world_size": 2, "bogus": 1})
        raise AssertionError("unknown init key accepted")
    except ValueError as exc:
        assert "bogus" in str(exc)

    model = Recorder()
    engine = WeightTransferEngineFactory.create_engine(
        WeightTransferConfig(backend="weightwire_tcp"), vllm_config, torch.device("cpu"), model
    )
    rng = np.random.default_rng(0)
    metas = [
        ParamMeta("model.layers.0.w", "bfloat16", (3, 5)),
        ParamMeta("model.layers.0.b", "uint8", (7,)),
        ParamMeta("model.norm.weight", "float32", (4,)),
    ]
    rounds = [[rng.integers(0, 256, m.nbytes, dtype=np.uint8) for m in metas] for _ in range(2)]
    rdv = TCPRendezvous(world_size=2)
    errors: list[BaseException] = []

    def trainer() -> None:
        try:
            comm = rdv.accept(timeout=30)
            comm.warmup(timeout=30)
            for arrays in rounds:
                for chunk in plan(metas, packed=True, buffer_size_bytes=16):
                    comm.broadcast(pack_host(arrays[chunk.start : chunk.stop], chunk), timeout=30)
            comm.close()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    info = {
        **rdv.init_fields(),
        "rank_offset": 1,
        "world_size": 2,
        "packed": True,
        "packed_buffer_size_bytes": 16,
        "packed_num_buffers": 2,
        "timeout_s": 30.0,
    }
    engine.init_transfer_engine(engine.parse_init_info(info))
    for i, arrays in enumerate(rounds):
        body = (
            UpdateInfo.from_metas(metas).to_dict()
            if i == 0
            else {"names": [], "dtype_names": [], "shapes": []}
        )
        engine.start_weight_update()
        engine.update_weights(body)
        engine.finish_weight_update()
        for meta, arr in zip(metas, arrays, strict=True):
            got = (
                model.loaded[meta.name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            )
            assert got == arr.tobytes(), f"round {i}: {meta.name} differs"
    engine.shutdown()
    thread.join(timeout=30)
    rdv.close()
    assert not errors, errors
    report({"ok": True, "vllm": vllm.__version__, "resolved": resolved, "rounds": len(rounds)})


RESULT_PREFIX = "WEIGHTWIRE_CHECK "


def report(result: dict) -> None:
    """One prefixed JSON line: vLLM writes its own lines to stdout too."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def _tiny_dirs(root: str) -> tuple[str, str]:
    from weightwire.tools.server.tiny import build_tiny

    dirs = []
    for seed in (0, 1):
        path = build_tiny("tiny-llama", os.path.join(root, f"tiny-llama-{seed}"), seed=seed)
        # vLLM's CPU attention has no head_dim-16 kernel; 2 heads x 32 keeps every weight shape.
        cfg_path = os.path.join(path, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg.update(num_attention_heads=2, num_key_value_heads=1, head_dim=32)
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        dirs.append(path)
    return dirs[0], dirs[1]


def check_llm(root: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams
    from vllm.config.weight_transfer import WeightTransferConfig

    from weightwire.backends.tcp.rendezvous import TCPRendezvous
    from weightwire.shared.framing import pack_host, plan
    from weightwire.shared.update_info import UpdateInfo
    from weightwire.torch_side.sender.source import ModuleSource

    d0, d1 = _tiny_dirs(root)
    ids = AutoTokenizer.from_pretrained(d0)("the quick brown fox", return_tensors="pt").input_ids
    hf = {d: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in (d0, d1)}
    ref = {
        d: m.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :].tolist()
        for d, m in hf.items()
    }
    assert ref[d0] != ref[d1], (
        "the two seeds must generate differently for the check to mean anything"
    )

    llm = LLM(
        model=d0,
        enforce_eager=True,
        dtype="float32",
        max_model_len=128,
        weight_transfer_config=WeightTransferConfig(backend="weightwire_tcp"),
    )
    params = SamplingParams(temperature=0, max_tokens=12)

    def greedy() -> list[int]:
        return list(
            llm.generate({"prompt_token_ids": ids[0].tolist()}, params)[0].outputs[0].token_ids
        )

    before = greedy()
    source = ModuleSource(hf[d1])
    metas, arrays = source.metadata(), [t.numpy() for _, t in source]
    rdv = TCPRendezvous(world_size=2)
    errors: list[BaseException] = []

    def trainer() -> None:
        try:
            comm = rdv.accept(timeout=60)
            comm.warmup(timeout=60)
            for _ in range(2):
                for chunk in plan(metas, packed=True, buffer_size_bytes=50_000):
                    comm.broadcast(pack_host(arrays[chunk.start : chunk.stop], chunk), timeout=60)
            comm.close()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=trainer, daemon=True)
    thread.start()
    llm.init_weight_transfer_engine(
        {
            "init_info": {
                **rdv.init_fields(),
                "rank_offset": 1,
                "world_size": 2,
                "packed": True,
                "packed_buffer_size_bytes": 50_000,
                "packed_num_buffers": 2,
                "timeout_s": 60.0,
            }
        }
    )
    outputs = []
    for body in (
        UpdateInfo.from_metas(metas).to_dict(),
        {"names": [], "dtype_names": [], "shapes": []},
    ):
        llm.start_weight_update()
        llm.update_weights({"update_info": body})
        llm.finish_weight_update()
        outputs.append(greedy())
    thread.join(timeout=60)
    rdv.close()
    assert not errors, errors
    assert before == ref[d0], (before, ref[d0])
    assert outputs == [ref[d1], ref[d1]], (outputs, ref[d1])
    return {"llm_ok": True, "tokens_after": outputs[0]}


if __name__ == "__main__":
    if "--llm" not in sys.argv:
        main()
    if "--llm" in sys.argv or "--all" in sys.argv:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            report(check_llm(tmp))
