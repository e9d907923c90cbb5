"""A trainer process that dies mid-broadcast: ``python -m tests.faults._trainer_proc CONFIG_JSON``.

Config: ``{"url", "model_dir", "kill_at", "stage_budget_bytes"?, "one_request"?}``
(``one_request``: its data path hears the workers, ``tests.faults.one_request``, so each
round is one request). It runs one good
round (version ``t1``), prints ``{"committed": {name: sha256}}`` as one JSON line, then
starts a second round and SIGKILLs itself just before yielding tensor ``kill_at``, once the server
is inside ``update_weights``: earlier chunks are on the wire, as in a trainer crash.
``kill_at`` ``"last_byte"``: it dies once its data path sent the second round's last byte,
before its update answered (printing ``{"sent": {name: sha256}}`` first).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from tests.faults.harness import Probe, TensorSource, engine_for, hook_at, load_weights
from tests.faults.one_request import hearing


def main() -> int:
    cfg = json.loads(sys.argv[1])
    source = TensorSource(load_weights(Path(cfg["model_dir"])))
    budget = (
        {"stage_budget_bytes": cfg["stage_budget_bytes"]} if "stage_budget_bytes" in cfg else {}
    )
    engine = engine_for(cfg["url"], source, **budget)
    wire = hearing(engine, cfg["url"]) if cfg.get("one_request") else None
    committed = source.perturb(101)
    engine.send_weights("t1")
    told: dict[str, object] = {"committed": committed}
    if wire is not None:
        told["one_request"] = wire.rounds[-1]
    print(json.dumps(told), flush=True)
    probe = Probe(cfg["url"])

    def die() -> None:  # once the server is inside update_weights, receiving this round
        probe.wait_session(lambda s: s["busy"] == "update_weights", timeout=10)
        os.kill(os.getpid(), signal.SIGKILL)

    if cfg["kill_at"] == "last_byte":
        sender, sent = engine.session.sender, source.perturb(102)
        send = sender.send

        def then_die(outgoing: object) -> object:
            done = send(outgoing)
            print(json.dumps({"sent": sent}), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
            return done

        sender.send = then_die
        engine.send_weights("t2")
        return 1
    source.hook = hook_at(cfg["kill_at"], die)
    source.perturb(102)
    engine.send_weights("t2")
    print(
        json.dumps({"error": "the second round finished although the process should be dead"}),
        flush=True,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
