"""Two trainer ranks as threads in one process, for the multi-broadcaster rules
(``test_broadcast_plan.py``): a ``DictGroup`` between them and a stub client that records
the calls, so what is checked is the ranks' agreement and gates, not a server.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import numpy as np

from tests.trainer.fakes import DictSource
from weightwire.shared.owned import OwnedSource
from weightwire.trainer.config import TrainerInitInfo
from weightwire.trainer.group import DictGroup


class StubClient:
    """Answers the calls a trainer's init and round make (records them); nothing else."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def version(self) -> str:
        return "0.33.0"

    def get_world_size(self) -> int:
        return 1

    def __getattr__(self, name: str) -> Any:
        if name in (
            "init_weight_transfer_engine",
            "start_weight_update",
            "update_weights",
            "finish_weight_update",
            "reset_prefix_cache",
        ):
            return lambda *a, **k: self.calls.append(name)
        raise AttributeError(name)


def run_ranks(
    backend: str, owner: Any, **info: Any
) -> tuple[list[BaseException | None], StubClient]:
    """``trainer_init`` on two JAX trainer ranks (threads, one ``DictGroup``) whose source owns
    a tensor where ``owner(name, rank)`` says; each rank's exception (or ``None``) and the
    shared client."""
    from weightwire.jax_side.dtypes import describe
    from weightwire.jax_side.engine import JAXTrainerEngine

    groups = DictGroup.make(2)
    client = StubClient()
    errors: list[BaseException | None] = [None, None]
    tensors = {
        "model.layers.0.w": np.zeros(2, np.float32),
        "model.layers.1.w": np.ones(2, np.float32),
    }

    def rank(r: int) -> None:
        try:
            source = OwnedSource(
                DictSource(dict(tensors), describe), lambda n, r=r: owner(n, r), rank=r
            )
            cfg = TrainerInitInfo(backend=backend, rank=r, pause_mode=None, **info)
            engine = JAXTrainerEngine.trainer_init(
                cfg, client=client, source=source, group=groups[r]
            )
        except BaseException as exc:  # recorded per rank
            errors[r] = exc
            return
        with contextlib.suppress(Exception):  # its beat thread ends with it
            engine.shutdown()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return errors, client
