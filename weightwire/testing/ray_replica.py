"""``ReplicaActor``: an inference replica shaped like a vLLM ``LLM`` Ray actor, for tests.

RL frameworks hold their inference engines as Ray actors and call vLLM's weight-sync
methods on them (``init_weight_transfer_engine(request)``, ``start_weight_update()``,
``update_weights(request)``, ``finish_weight_update(version)``, ...). This class has
that method set over a weightwire worker engine loading into a Hugging Face model on
CPU, so a trainer driven through ``RayWeightSyncClient`` can be tested against real Ray
actors without vLLM::

    import ray
    from weightwire.testing.ray_replica import ReplicaActor

    Replica = ray.remote(num_cpus=0)(ReplicaActor)
    actors = [Replica.remote(model_dir) for _ in range(2)]
    client = RayWeightSyncClient(actors, world_sizes=1, server_version="0.33.0")

Like the reference server's workers, a round is staged and applied at finish (a failed
round keeps the previous weights), and a new init replaces the previous session.
``state_checksums`` answers what ``/weight_checker`` would: sha256 per parameter.
torch and transformers are imported in the actor, not here.
"""

from __future__ import annotations

from typing import Any

from weightwire import backends


def _field(request: Any, key: str) -> Any:
    """vLLM's request object or its dict form (``{"init_info": ...}``)."""
    return request[key] if isinstance(request, dict) else getattr(request, key)


def _cpu_backend() -> str:
    """The first registered backend a CPU worker receives (the registry lists it first)."""
    return next(n for n, s in backends.SPECS.items() if not s.needs_cuda and s.connect is not None)


class ReplicaActor:
    """One replica: a Hugging Face model, its ``HFModelHost``, one transfer engine per session."""

    def __init__(
        self,
        model_dir: str,
        *,
        backend: str | None = None,
        device: str = "cpu",
        threads: int = 1,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from weightwire.torch_side.worker.hf_host import HFModelHost

        hf_logging.disable_progress_bar()
        torch.set_num_threads(threads)  # a replica shares the host's cores with its neighbours
        self.backend = backend if backend is not None else _cpu_backend()
        self.device = torch.device(device)
        # transformers wraps PreTrainedModel.to with functools.wraps, which mypy reads as unbound
        # (self: the model).
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").to(self.device).eval()  # type: ignore[arg-type]
        self.host = HFModelHost(model)
        self.engine: Any = None
        self.weight_version = "default"
        self.paused = False

    def __repr__(self) -> str:
        return f"ReplicaActor(backend={self.backend!r}, version={self.weight_version!r})"

    def _require_engine(self) -> Any:
        if self.engine is None:
            raise RuntimeError("weight transfer engine is not initialized on this replica")
        return self.engine

    def init_weight_transfer_engine(self, request: Any) -> None:
        self.shutdown_weight_transfer_engine()  # a new trainer's session replaces the previous one
        engine = backends.worker_engine(self.backend).standalone(
            model=self.host, device=self.device
        )
        try:
            engine.init_transfer_engine(engine.parse_init_info(_field(request, "init_info")))
        except BaseException:
            engine.shutdown()
            raise
        self.engine = engine

    def start_weight_update(self) -> None:
        self._require_engine().start_weight_update()

    def update_weights(self, request: Any) -> None:
        self._require_engine().update_weights(_field(request, "update_info"))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._require_engine().finish_weight_update()
        if weight_version is not None:
            self.weight_version = weight_version

    def shutdown_weight_transfer_engine(self) -> None:
        from weightwire.torch_side.worker.hf_host import close_engine

        engine, self.engine = self.engine, None
        close_engine(engine, self.host)

    def get_weight_version(self) -> str:
        return self.weight_version

    def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.paused = True  # nothing generates here; kept for the call set's sake

    def resume_generation(self) -> None:
        self.paused = False

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        return True  # no KV cache here: nothing computed under the old weights can be served

    def state_checksums(self) -> dict[str, str]:
        """``{parameter name: sha256 of its bytes}``, what the replica serves now."""
        return self.host.state_checksums()
