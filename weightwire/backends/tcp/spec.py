"""The spec of ``weightwire_tcp`` (data only: ``weightwire.backends.spec``)."""

from __future__ import annotations

from weightwire.backends.spec import BackendSpec

_ENGINES = "weightwire.torch_side.worker.engines"
_VLLM = "weightwire.torch_side.worker.vllm_engines"

TCP = BackendSpec(
    name="weightwire_tcp",
    init_info="weightwire.backends.tcp.info:TCPInitInfo",
    trainer="weightwire.backends.tcp.trainer:TCPBackend",
    connect="weightwire.backends.tcp.worker:connect_tcp",
    worker_engine=f"{_ENGINES}:WeightwireTCPEngine",
    vllm_engine=f"{_VLLM}:VllmWeightwireTCPEngine",
    needs_cuda=False,
    stock_receiver=False,
    aliases=("tcp",),  # unambiguous; ``nccl`` is vLLM's own backend
)
"""TCP data plane, no GPU needed; needs the weightwire plugin in vLLM."""

SPECS = (TCP,)
