"""The specs of the NCCL backends: vLLM's own ``nccl``, ``sparse_nccl`` and ``nccl_m2n``, and
``weightwire_nccl`` (data only: ``weightwire.backends.spec``)."""

from __future__ import annotations

from dataclasses import replace

from weightwire.backends.spec import BackendSpec

_INFO = "weightwire.backends.nccl.info"
_ENGINES = "weightwire.torch_side.worker.engines"

WEIGHTWIRE_NCCL = BackendSpec(
    name="weightwire_nccl",
    init_info=f"{_INFO}:WeightwireNCCLInitInfo",
    trainer="weightwire.backends.nccl.trainer:WeightwireNCCLBackend",
    connect="weightwire.backends.nccl.worker:connect_nccl",
    worker_engine=f"{_ENGINES}:WeightwireNCCLEngine",
    vllm_engine="weightwire.torch_side.worker.vllm_engines:VllmWeightwireNCCLEngine",
    needs_cuda=True,
    stock_receiver=False,
)
"""vLLM's NCCL wire plus a worker-side receive timeout; needs the plugin."""

NCCL = BackendSpec(
    name="nccl",
    init_info=f"{_INFO}:NCCLInitInfo",
    trainer="weightwire.backends.nccl.trainer:NCCLBackend",
    connect=None,
    worker_engine=f"{_ENGINES}:WeightwireNCCLEngine",
    vllm_engine=None,
    needs_cuda=True,
    stock_receiver=True,
    default=True,  # what a stock vLLM serves with no plugin
)
"""vLLM's own dense NCCL backend (unique-id rendezvous); no plugin."""

SPARSE_NCCL = replace(
    NCCL,
    name="sparse_nccl",
    trainer="weightwire.backends.nccl.trainer:SparseNCCLBackend",
    dense_rounds=False,
    default=False,  # nccl is the default backend; its sparse twin is not
)
"""vLLM's own sparse NCCL backend (>= 0.30): delta rounds only, applied in place; no plugin.
Outside vLLM nothing receives its rounds (the listed engine parses its init info and refuses
its update info)."""

NCCL_M2N = BackendSpec(
    name="nccl_m2n",
    init_info=f"{_INFO}:M2NInitInfo",
    trainer="weightwire.backends.nccl.m2n_trainer:NcclM2NBackend",
    connect=None,
    worker_engine=None,
    vllm_engine=None,
    needs_cuda=True,
    stock_receiver=True,
)
"""vLLM 0.33's own ``nccl_m2n``: every trainer device sends its own shard of each tensor,
resharded into the workers' layout (``nccl.m2n``); no plugin, and nothing outside vLLM
receives it."""

SPECS = (WEIGHTWIRE_NCCL, NCCL, SPARSE_NCCL, NCCL_M2N)
