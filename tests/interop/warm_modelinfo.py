"""Fill vLLM's model-info cache for the given architectures, in one process.

Run with the interop venv's interpreter and ``VLLM_CACHE_ROOT`` set::

    /path/to/vllm-venv/bin/python tests/interop/warm_modelinfo.py LlamaForCausalLM Qwen2ForCausalLM

Every vLLM start inspects its model class in a fresh subprocess (vLLM does it there to
keep CUDA out of the API server) unless ``$VLLM_CACHE_ROOT/modelinfos`` already holds
the class's info, keyed by the hash of its source file. That subprocess re-imports vLLM
and torch: ~13 s of every start on the CI box. Here the inspection runs in this process
(no CUDA on a CPU box) for all the lane's architectures at once, writing the same cache
files vLLM itself writes, so each server then reads them instead. An unknown
architecture fails here, naming it.
"""

from __future__ import annotations

import sys


def main(architectures: list[str]) -> None:
    from vllm.model_executor.models import registry

    known = registry.ModelRegistry.models
    unknown = sorted(set(architectures) - set(known))
    if unknown:
        raise SystemExit(f"vLLM has no architectures {unknown}")
    # The subprocess only guards CUDA initialisation, which a CPU box does not have.
    registry._run_in_subprocess = lambda fn: fn()
    for arch in architectures:
        known[arch].inspect_model_cls()
    print(f"warmed {len(architectures)} architectures", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
