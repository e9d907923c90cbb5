"""A JAX trainer that stops at a chosen point of a round and waits to be SIGKILLed.

    python tests/interop/dying_trainer.py URL MODEL_DIR PHASE SEED [STAGE_BUDGET_BYTES [TRANSFER_S]]

PHASE: ``after_start`` (start_weight_update answered), ``mid_update`` (about half of
the round's tensors sent and the update in flight at the server: its workers read them,
``_update_in_flight``), ``before_finish`` (every byte sent and the update answered, finish
not posted). Prints ``PHASE <phase>`` when it got there, then blocks; the fault cases kill it
with SIGKILL. A phase it cannot reach within ``PHASE_BOUND_S`` prints ``PHASE never <phase>:
<why>`` and exits 3. ``STAGE_BUDGET_BYTES``
``0``: the workers apply the round in place (and the trainer holds the round guard and pauses
generation with ``abort``);
``TRANSFER_S``: the per-broadcast bound the workers get (a stalled trainer then fails
their receive). ``$DYING_TRAINER_UPDATE_DELAY_S``: the update POST leaves that late (its bytes
wait in the sockets meanwhile: the race a ``mid_update`` kill once lost).
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
import time
from typing import Any

from tests.interop.models import jax_params, perturbed
from weightwire.control.client import HTTPWeightSyncClient
from weightwire.jax_side.engine import JAXTrainerEngine
from weightwire.jax_side.source import PytreeSource
from weightwire.shared.timeouts import Timeouts
from weightwire.trainer.config import TrainerInitInfo

PACKED_BYTES = 16 << 10
PHASE_BOUND_S = 60.0
"""How long a phase may take to come (``mid_update``: the update POST reaching the workers)."""
_TCP_ESTABLISHED = "01"
_BYTES_ACKED = struct.Struct("=Q")
_BYTES_ACKED_AT = 120
"""``tcpi_bytes_acked`` in Linux's ``struct tcp_info`` (since 4.2)."""


def _reached(phase: str) -> None:
    print(f"PHASE {phase}", flush=True)
    threading.Event().wait()  # until SIGKILL


def _never(phase: str, why: str) -> None:
    print(f"PHASE never {phase}: {why}", flush=True)
    os._exit(3)


def _tcp_rows() -> dict[str, list[str]]:
    """Every TCP socket of this network namespace, ``local->remote`` (as /proc writes them)
    -> its /proc/net/tcp{,6} columns."""
    rows: dict[str, list[str]] = {}
    for table in ("tcp", "tcp6"):
        with open(f"/proc/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                rows[f"{cols[1]}->{cols[2]}"] = cols
    return rows


def _link_state(sock: socket.socket, rows: dict[str, list[str]]) -> str | None:
    """None once the worker at the other end of ``sock`` read every byte this process sent on
    it and a whole packed buffer or more went (the round's data: the handshake and warm-up
    are ~100 bytes); else what is still missing."""
    inode = str(os.fstat(sock.fileno()).st_ino)
    ours = next((cols for cols in rows.values() if cols[9] == inode), None)
    if ours is None or ours[3] != _TCP_ESTABLISHED:
        return f"{sock}: not an established TCP socket ({ours and ours[3]})"
    theirs = rows.get(f"{ours[2]}->{ours[1]}")
    if theirs is None:
        return f"{sock}: its peer's end is not a socket on this host; cannot see it read"
    acked = _BYTES_ACKED.unpack_from(
        sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256), _BYTES_ACKED_AT
    )[0]
    unacked = int(ours[4].split(":")[0], 16)  # tx_queue: SIOCOUTQ, sent but not acknowledged
    unread = int(theirs[4].split(":")[1], 16)  # rx_queue: FIONREAD at the worker
    if acked < PACKED_BYTES or unacked or unread or theirs[3] != _TCP_ESTABLISHED:
        return f"{sock}: acked {acked} B, unacked {unacked} B, unread by the worker {unread} B"
    return None


def _update_in_flight(engine: Any, bound: float = PHASE_BOUND_S) -> None:
    """Return once the round's update is in flight at the server: on every data link the
    worker read every byte sent (workers read a link only inside an update), a packed buffer
    or more of them. Bytes merely sent may wait in the sockets' buffers with no update posted
    yet (a small model's half fits there), and a trainer killed then leaves the server no
    update to fail. Exits the process (``_never``) past ``bound``."""
    link = engine.session.link
    links = getattr(link, "_links", None)
    if not links:
        _never("mid_update", f"no TCP data links to watch on {link!r}")
    deadline = time.monotonic() + bound
    while True:
        rows = _tcp_rows()
        missing = [m for m in (_link_state(peer.sock, rows) for peer in links) if m]
        if not missing:
            return
        if time.monotonic() > deadline:
            _never("mid_update", f"the workers did not read the round within {bound} s: {missing}")
        time.sleep(0.01)


class _StallingSource(PytreeSource):
    """Yields the first ``stop_after`` tensors, then stalls (mid-update) once the update is in
    flight at the server."""

    stop_after = 0
    engine: Any = None

    def iter_groups(self):  # type: ignore[override]  (the engine drives a source group by group)
        sent = 0
        for group in super().iter_groups():
            if sent >= self.stop_after:
                _update_in_flight(self.engine)
                _reached("mid_update")
            sent += len(group)
            yield group


def _delayed_updates(client: HTTPWeightSyncClient, delay_s: float) -> None:
    """Each update POST (alone, with its finish, or the whole round in one request) leaves
    ``delay_s`` late."""
    for name in ("update_weights", "update_and_finish", "start_update_finish"):
        real = getattr(client, name)

        def late(*args: Any, _real: Any = real, **kwargs: Any) -> Any:
            time.sleep(delay_s)
            return _real(*args, **kwargs)

        setattr(client, name, late)


def main() -> None:
    url, model_dir, phase, seed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    params, naming = jax_params(model_dir)
    params = perturbed(params, seed)
    source_cls = _StallingSource if phase == "mid_update" else PytreeSource
    source = source_cls(lambda: params, naming)
    _StallingSource.stop_after = len(source.metadata()) // 2
    client = HTTPWeightSyncClient(url, timeout=120)
    if os.environ.get("DYING_TRAINER_UPDATE_DELAY_S"):
        _delayed_updates(client, float(os.environ["DYING_TRAINER_UPDATE_DELAY_S"]))
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
    info = TrainerInitInfo(backend="weightwire_tcp", packed_buffer_size_bytes=PACKED_BYTES, **extra)
    engine = JAXTrainerEngine.trainer_init(info, client=client, source=source)
    _StallingSource.engine = engine
    engine.send_weights(weight_version=f"dying-{phase}")
    print("PHASE finished (should not happen)", flush=True)


if __name__ == "__main__":
    main()
