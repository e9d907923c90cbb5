"""The workers' side of the round guard: ``WORKER_METHOD``, each worker's answer to whether
its weights are whole, installed on vLLM's workers by the plugin with the other worker methods
weightwire asks through ``/collective_rpc`` (the served model, the latest round's bytes).
Torch-free; imports vLLM only inside ``install_worker_method``.
"""

from __future__ import annotations

from typing import Any

from weightwire.shared.routes import ROUND_STATS_METHOD as STATS_METHOD
from weightwire.shared.routes import SERVED_MODEL_METHOD as SERVED_METHOD

WORKER_METHOD = "weightwire_round_state"
"""The worker method the guard calls through vLLM's ``collective_rpc`` at a release."""


def worker_round_state(worker: Any, call: str | None = None) -> dict[str, Any]:
    """``WORKER_METHOD``: this worker's answer (installed on vLLM's ``WorkerBase``), naming
    the ``call`` it answers (the guard checks that each worker answered its call, not an
    earlier one)."""
    return {**_round_state(worker), "call": call}


def _round_state(worker: Any) -> dict[str, Any]:
    engine = getattr(worker, "weight_transfer_engine", None)
    if engine is None:
        return {"whole": True, "engine": None, "reason": None}
    name = type(engine).__name__
    if not hasattr(engine, "incomplete_round"):
        return {
            "whole": None,
            "engine": name,
            "reason": f"weight-transfer engine {name} is not weightwire's: "
            "it cannot tell whether the weights are whole",
        }
    incomplete = engine.incomplete_round
    if incomplete is not None:
        return {"whole": False, "engine": name, "reason": incomplete.describe()}
    if getattr(engine, "round_strategy", None) in ("streaming", "write_through", "sliced_in_place"):
        return {
            "whole": False,
            "engine": name,
            "reason": "a round applied in place is open (not committed yet)",
        }
    return {"whole": True, "engine": name, "reason": None}


def worker_served_model(worker: Any) -> dict[str, Any] | None:
    """``SERVED_METHOD``: what this worker's model takes, as its weightwire
    engine's spec says (``None``: no weightwire engine, or it cannot tell)."""
    engine = getattr(worker, "weight_transfer_engine", None)
    tell = getattr(engine, "served_model", None)
    return tell() if callable(tell) else None


def worker_round_stats(worker: Any) -> dict[str, Any] | None:
    """``STATS_METHOD``: what this worker received in its latest round, as its weightwire
    engine counted it (``None``: no weightwire engine, or no round yet)."""
    engine = getattr(worker, "weight_transfer_engine", None)
    tell = getattr(engine, "round_stats", None)
    return tell() if callable(tell) else None


def install_worker_method() -> None:
    """Give vLLM's workers ``WORKER_METHOD``, ``SERVED_METHOD`` and ``STATS_METHOD`` (new
    names; nothing of vLLM's is replaced)."""
    try:
        from vllm.v1.worker.worker_base import WorkerBase
    except ImportError:
        return
    if not hasattr(WorkerBase, WORKER_METHOD):
        setattr(WorkerBase, WORKER_METHOD, worker_round_state)
    if not hasattr(WorkerBase, SERVED_METHOD):
        setattr(WorkerBase, SERVED_METHOD, worker_served_model)
    if not hasattr(WorkerBase, STATS_METHOD):
        setattr(WorkerBase, STATS_METHOD, worker_round_stats)
