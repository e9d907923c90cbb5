"""A JAX trainer that stops at a chosen point of a round and waits to be SIGKILLed.

    python tests/interop/dying_trainer.py URL MODEL_DIR PHASE SEED [STAGE_BUDGET_BYTES [TRANSFER_S]]

PHASE: ``after_start`` (start_weight_update answered), ``mid_update`` (about half of
the round's tensors sent, the update POST in flight), ``before_finish`` (every byte
sent and the update answered, finish not posted). Prints ``PHASE <phase>`` when it
got there, then blocks; the interop fault cases kill it with SIGKILL. ``STAGE_BUDGET_BYTES``
``0``: the workers apply the round in place (and the trainer holds the round guard and pauses
generation with ``abort``);
``TRANSFER_S``: the per-broadcast bound the workers get (a stalled trainer then fails
their receive).
"""

from __future__ import annotations

import os
import sys
import threading

from tests.interop.models import jax_params, perturbed
from weightwire.control.client import HTTPWeightSyncClient
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.jax_side.source import PytreeSource
from weightwire.shared.timeouts import Timeouts
from weightwire.trainer.config import TrainerInitInfo


def _reached(phase: str) -> None:
    print(f"PHASE {phase}", flush=True)
    threading.Event().wait()  # until SIGKILL


class _StallingSource(PytreeSource):
    """Yields the first ``stop_after`` tensors, then stalls (mid-update)."""

    stop_after = 0

    def iter_groups(self):  # type: ignore[override]  (the engine drives a source group by group)
        sent = 0
        for group in super().iter_groups():
            if sent >= self.stop_after:
                _reached("mid_update")
            sent += len(group)
            yield group


def main() -> None:
    url, model_dir, phase, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    params, naming = jax_params(model_dir)
    params = perturbed(params, seed)
    source_cls = _StallingSource if phase == "mid_update" else PytreeSource
    source = source_cls(lambda: params, naming)
    _StallingSource.stop_after = len(source.metadata()) // 2
    client = HTTPWeightSyncClient(url, timeout=120)
    if phase == "after_start":
        real = client.start_weight_update
        client.start_weight_update = lambda: (real(), _reached(phase))  # type: ignore[method-assign]
    elif phase == "before_finish":
        client.finish_weight_update = lambda *a, **k: _reached(phase)  # type: ignore[method-assign]
    extra: dict = {"stage_budget_bytes": int(sys.argv[5])} if len(sys.argv) > 5 else {}
    if len(sys.argv) > 6:
        extra["timeouts"] = Timeouts(transfer_s=float(sys.argv[6]))
    if os.environ.get("DYING_TRAINER_SLICED"):
        extra["sliced"] = os.environ["DYING_TRAINER_SLICED"]
    info = TrainerInitInfo(backend="weightwire_tcp", packed_buffer_size_bytes=16 << 10, **extra)
    engine = JAXTrainerEngine.trainer_init(info, client=client, source=source)
    engine.send_weights(weight_version=f"dying-{phase}")
    print("PHASE finished (should not happen)", flush=True)


if __name__ == "__main__":
    main()
