"""A link shaped to a fixed rate, for benchmarks: a relay process between a ``weightwire_tcp``
trainer and its worker that forwards every byte through a token bucket.

The worker dials the relay instead of the trainer (``RelayedClient`` rewrites the
``host``/``port`` of the init info it forwards); the relay dials the trainer's listener and
pumps each direction through its own bucket (a full-duplex line: ``rate`` bytes/s each way,
at most one ``chunk`` early). The library is untouched: it sees an ordinary, slower peer.
The relay is a separate process so its copying never competes with the trainer's threads
for the GIL; the bytes it forwarded are counted, so a benchmark can check the link ran at
the rate it was shaped to.
"""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing as mp
import os
import socket
import threading
import time
from typing import Any

from weightwire.testing.loopback import LoopbackClient

_REPLY_S = 30.0  # the relay answers each command within this


class TokenBucket:
    """``take(n)`` returns once ``n`` more bytes fit under ``rate`` bytes/s, with at most
    ``burst`` bytes sent ahead of the rate after an idle spell."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, burst
        self._paid_until = time.monotonic()  # when the bytes taken so far are paid for

    def take(self, n: int) -> None:
        now = time.monotonic()
        self._paid_until = max(self._paid_until, now - self.burst / self.rate) + n / self.rate
        if self._paid_until > now:
            time.sleep(self._paid_until - now)


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)


def _pump(
    src: socket.socket, dst: socket.socket, bucket: TokenBucket, count: list[int], chunk: int
) -> None:
    """Forward ``src`` to ``dst`` through ``bucket`` until either end closes. The bytes move
    through a kernel pipe (``os.splice``): no copy through Python, so the relay keeps up
    with rates of several GB/s."""
    r, w = os.pipe()
    try:
        with contextlib.suppress(OSError):
            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, chunk)
        while True:
            n = os.splice(src.fileno(), w, chunk)
            if n == 0:
                break
            bucket.take(n)
            left = n
            while left:
                left -= os.splice(r, dst.fileno(), left)
            count[0] += n
    except OSError:
        pass
    finally:
        os.close(r)
        os.close(w)
        for s in (src, dst):  # one side gone: the other learns at once
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def _serve(listener: socket.socket, state: dict[str, Any], rate: float, chunk: int) -> None:
    """Accept workers; each is joined to the trainer endpoint set last (``state["target"]``)."""
    while True:
        try:
            worker, _ = listener.accept()
        except OSError:
            return
        try:
            trainer = socket.create_connection(state["target"], timeout=10)
        except OSError:
            worker.close()
            continue
        trainer.settimeout(None)
        for s in (worker, trainer):
            _tune(s)
        for src, dst, key in ((trainer, worker, "down"), (worker, trainer, "up")):
            bucket = TokenBucket(rate, chunk)
            args = (src, dst, bucket, state[key], chunk)
            threading.Thread(target=_pump, args=args, daemon=True).start()


def relay_main(conn: Any, rate: float, chunk: int) -> None:
    """The relay process: reports its port, then answers ``("target", host, port)``,
    ``("count",)`` (bytes forwarded trainer -> worker so far) and ``("stop",)``."""
    listener = socket.create_server(("127.0.0.1", 0))
    _tune(listener)
    state: dict[str, Any] = {"target": None, "down": [0], "up": [0]}
    threading.Thread(target=_serve, args=(listener, state, rate, chunk), daemon=True).start()
    conn.send(listener.getsockname()[1])
    while True:
        cmd = conn.recv()
        if cmd[0] == "target":
            state["target"] = (cmd[1], cmd[2])
            conn.send(True)
        elif cmd[0] == "count":
            conn.send(state["down"][0])
        else:
            listener.close()
            conn.send(True)
            return


class ShapedLink:
    """The relay process and its control pipe: ``port`` is where workers dial."""

    def __init__(self, rate: float, chunk: int = 1 << 20) -> None:
        self.rate = rate
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=relay_main, args=(child, rate, chunk), daemon=True)
        self._proc.start()
        self.port: int = self._ask(None)

    def _ask(self, cmd: tuple | None) -> Any:
        if cmd is not None:
            self._conn.send(cmd)
        if not self._conn.poll(_REPLY_S):
            raise TimeoutError(f"the link relay did not answer {cmd!r} in {_REPLY_S} s")
        return self._conn.recv()

    def target(self, host: str, port: int) -> None:
        """Join the next worker that dials to the trainer listening at ``host:port``."""
        self._ask(("target", host, port))

    def forwarded(self) -> int:
        """Bytes the relay passed from trainers to workers so far."""
        return int(self._ask(("count",)))

    def close(self) -> None:
        if self._proc.is_alive():
            with contextlib.suppress(OSError, EOFError, TimeoutError):
                self._ask(("stop",))
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()


class RelayedClient(LoopbackClient):
    """A loopback client whose worker dials ``link`` instead of the trainer's listener."""

    def __init__(self, address: str, link: ShapedLink) -> None:
        super().__init__(address)
        self.link = link

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        info = dict(init_info)
        if info.get("sources"):
            raise ValueError("the shaped link relays a single broadcaster only")
        self.link.target(info["host"], int(info["port"]))
        info.update(host="127.0.0.1", port=self.link.port)
        super().init_weight_transfer_engine(info)


def relay_ceiling(nbytes: int = 1 << 30, timeout: float = 60.0) -> float:
    """Bytes/s the relay forwards when not shaped (a socket pair's worth of Python on each
    end): a shaped rate well below it is what the link runs at, not the relay's limit."""
    link = ShapedLink(rate=1e15)
    server = socket.create_server(("127.0.0.1", 0))
    try:
        link.target("127.0.0.1", server.getsockname()[1])
        server.settimeout(timeout)

        def send() -> None:
            with contextlib.suppress(OSError):
                conn, _ = server.accept()
                with conn:
                    block = memoryview(bytearray(8 << 20))
                    for _ in range(-(-nbytes // len(block))):
                        conn.sendall(block)

        threading.Thread(target=send, daemon=True).start()
        got, buf = 0, memoryview(bytearray(8 << 20))
        with socket.create_connection(("127.0.0.1", link.port), timeout=timeout) as sock:
            start = time.perf_counter()
            while got < nbytes:
                n = sock.recv_into(buf)
                if n == 0:
                    raise ConnectionError(f"the relay closed after {got} of {nbytes} bytes")
                got += n
            return got / (time.perf_counter() - start)
    finally:
        server.close()
        link.close()
