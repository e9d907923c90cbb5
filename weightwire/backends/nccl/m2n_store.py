"""The metadata rendezvous of vLLM's ``nccl_m2n`` receiver, served without torch.

vLLM 0.33's ``nccl_m2n`` workers agree on the transfer plan with the trainer ranks before
any NCCL call, over vLLM's ``StatelessProcessGroup`` (``vllm/distributed/utils.py``): a
``torch.distributed.TCPStore`` whose *server* is group rank 0, the trainer, at the init
info's ``master_address:master_port`` (``stateless_init_metadata_group`` in
``nccl_common.py``; the workers join as clients). A torch-free trainer therefore has to
answer torch's store protocol itself. ``MetadataStore`` does: a small threaded server of the
client requests a torch ``TCPStore`` client sends (checked against torch 2.13's client in
``tests/backends/test_m2n_store.py``), all little-endian:

- on connect, ``VALIDATE`` (query 0) with the magic ``0x3C85F7CE``, then ``PING`` (13) with a
  ``uint32`` nonce, echoed back;
- a key is a ``uint64`` length and its bytes, a value the same; ``SET`` (1) stores,
  ``GET`` (3) answers the value, ``ADD`` (4) adds an ``int64`` to a decimal counter and answers
  it, ``CHECK`` (5) / ``WAIT`` (6) take a ``uint64`` count of keys and answer one byte
  (ready / stop waiting) once all are set, ``CANCEL_WAIT`` (12) answers "canceled";
  ``COMPARE_SET``, ``GETNUMKEYS``, ``DELETE_KEY``, ``APPEND``, ``MULTI_GET``, ``MULTI_SET`` as
  torch's own server. Anything else closes that connection.

``MetadataGroup`` is rank 0's side of the group's key scheme, as vLLM's class writes and
reads it: ``broadcast_from/{src}/{n}`` (each rank's n-th broadcast; an all-gather is one
broadcast per rank, in rank order) and ``send_to/{dst}/{n}``, values pickled. What the
workers publish is read with an unpickler that builds only plain data (dicts, lists,
strings, bytes, numbers): a peer that sends anything else is refused, nothing of it runs.
Every wait has a deadline (``TransferTimeout`` names the key it waited for).
"""

from __future__ import annotations

import contextlib
import io
import pickle
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from weightwire.shared.errors import PeerLost, TransferError, TransferTimeout

VALIDATION_MAGIC = 0x3C85F7CE
"""What a torch ``TCPStore`` client sends first (``validationMagicNumber``)."""

(
    VALIDATE,
    SET,
    COMPARE_SET,
    GET,
    ADD,
    CHECK,
    WAIT,
    GETNUMKEYS,
    DELETE_KEY,
    APPEND,
    MULTI_GET,
    MULTI_SET,
    CANCEL_WAIT,
    PING,
) = range(14)
READY, NOT_READY = 0, 1
STOP_WAITING, WAIT_CANCELED = 0, 1

MAX_VALUE_BYTES = 64 << 20
"""A key or value longer than this closes the connection (vLLM's envelopes are a few KiB;
the largest, the source plan's digest, is a hex string)."""
INIT_KEY = "init/"
"""The counter every torch client adds 1 to when it joins (``waitForWorkers``; unprefixed)."""
KEY_PREFIX = "/"
"""What a torch client puts before every key its user names (``keyPrefix_``)."""


class StoreError(TransferError):
    """The metadata rendezvous failed: a peer sent something the store does not take."""


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = conn.recv(n - len(buf))
        if not part:
            raise EOFError
        buf += part
    return bytes(buf)


def _recv_u64(conn: socket.socket) -> int:
    return int(struct.unpack("<Q", _recv_exact(conn, 8))[0])


def _recv_bytes(conn: socket.socket) -> bytes:
    n = _recv_u64(conn)
    if n > MAX_VALUE_BYTES:
        raise EOFError
    return _recv_exact(conn, n)


def _vector(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


class MetadataStore:
    """A torch-compatible ``TCPStore`` server (see the module docstring), and rank 0's own
    direct access to its keys."""

    def __init__(self, host: str, port: int = 0) -> None:
        self._keys: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._conns: list[socket.socket] = []
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._listener.settimeout(0.2)
        self.host = host
        self.port = int(self._listener.getsockname()[1])
        self._thread = threading.Thread(target=self._accept, name="m2n-store", daemon=True)
        self._thread.start()

    # -- rank 0's own access ----------------------------------------------------------------

    def set(self, key: str, value: bytes) -> None:
        with self._cond:
            self._keys[key] = bytes(value)
            self._cond.notify_all()

    def get(
        self, key: str, *, deadline: float, what: str, check: Callable[[], None] | None = None
    ) -> bytes:
        """The value of ``key`` once set; ``TransferTimeout`` at ``deadline``. ``check`` runs
        between waits and raises to end it (the init call already failed)."""
        with self._cond:
            while key not in self._keys:
                if check is not None:
                    self._cond.release()
                    try:
                        check()
                    finally:
                        self._cond.acquire()
                    if key in self._keys:
                        break
                left = deadline - time.monotonic()
                if self._closed:
                    raise PeerLost(f"the metadata store closed while waiting for {what}")
                if left <= 0:
                    raise TransferTimeout(
                        f"timed out waiting for {what} (store key {key!r}) on the nccl_m2n "
                        "metadata rendezvous: a worker did not reach this step (see its log)"
                    )
                self._cond.wait(min(left, 0.5))
            return self._keys[key]

    def keys(self) -> list[str]:
        with self._cond:
            return list(self._keys)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            conns, self._conns = self._conns, []
        self._listener.close()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        self._thread.join(timeout=5)

    # -- the server -------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._cond:
                if self._closed:
                    conn.close()
                    return
                self._conns.append(conn)
            threading.Thread(
                target=self._serve, args=(conn,), name="m2n-store-conn", daemon=True
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                self._query(conn, _recv_exact(conn, 1)[0])
        except (EOFError, OSError):  # the connection ended or broke the protocol: drop it
            pass
        finally:
            with self._cond:
                if conn in self._conns:
                    self._conns.remove(conn)
            conn.close()

    def _wait_keys(self, keys: list[str], conn: socket.socket) -> bool:
        """Block this connection's thread until every key is set: True, or False when the
        client canceled (its next query is ``CANCEL_WAIT``) or the store closed."""
        # A torch client gives up on its own timeout by sending CANCEL_WAIT; until then it
        # reads nothing else, so a helper waits on the keys while this thread watches for it.
        done = threading.Event()

        def wake() -> None:
            with self._cond:
                while not self._closed and not all(k in self._keys for k in keys):
                    if done.is_set():
                        return
                    self._cond.wait(0.5)
            done.set()

        waiter = threading.Thread(target=wake, name="m2n-store-wait", daemon=True)
        waiter.start()
        conn.settimeout(0.05)
        try:
            while not done.is_set():
                try:
                    peek = conn.recv(1, socket.MSG_PEEK)
                except TimeoutError:
                    continue
                if not peek:
                    raise EOFError
                if peek[0] == CANCEL_WAIT:
                    done.set()
                    return False
                raise EOFError  # anything but a cancel while waiting breaks the protocol
        finally:
            conn.settimeout(None)
            done.set()
        with self._cond:
            return all(k in self._keys for k in keys)

    def _query(self, conn: socket.socket, q: int) -> None:
        if q == VALIDATE:
            if struct.unpack("<I", _recv_exact(conn, 4))[0] != VALIDATION_MAGIC:
                raise EOFError
        elif q == PING:
            conn.sendall(_recv_exact(conn, 4))
        elif q == SET:
            key, value = _recv_bytes(conn).decode(), _recv_bytes(conn)
            self.set(key, value)
        elif q == GET:
            key = _recv_bytes(conn).decode()
            with self._cond:
                found = self._keys.get(key)
            if found is None:  # torch's server fails the query, and so the connection
                raise EOFError
            conn.sendall(_vector(found))
        elif q == ADD:
            key = _recv_bytes(conn).decode()
            (delta,) = struct.unpack("<q", _recv_exact(conn, 8))
            with self._cond:
                total = int(self._keys.get(key, b"0").decode() or 0) + int(delta)
                self._keys[key] = str(total).encode()
                self._cond.notify_all()
            conn.sendall(struct.pack("<q", total))
        elif q in (CHECK, WAIT):
            keys = [_recv_bytes(conn).decode() for _ in range(_recv_u64(conn))]
            if q == CHECK:
                with self._cond:
                    ready = all(k in self._keys for k in keys)
                conn.sendall(bytes([READY if ready else NOT_READY]))
            elif self._wait_keys(keys, conn):
                conn.sendall(bytes([STOP_WAITING]))
        elif q == CANCEL_WAIT:
            conn.sendall(bytes([WAIT_CANCELED]))
        elif q == COMPARE_SET:
            key = _recv_bytes(conn).decode()
            current, new = _recv_bytes(conn), _recv_bytes(conn)
            with self._cond:
                if key not in self._keys:
                    if not current:
                        self._keys[key] = new
                    out = current if current else new
                else:
                    if self._keys[key] == current:
                        self._keys[key] = new
                    out = self._keys[key]
                self._cond.notify_all()
            conn.sendall(_vector(out))
        elif q == GETNUMKEYS:
            with self._cond:
                conn.sendall(struct.pack("<q", len(self._keys)))
        elif q == DELETE_KEY:
            key = _recv_bytes(conn).decode()
            with self._cond:
                n = 1 if self._keys.pop(key, None) is not None else 0
            conn.sendall(struct.pack("<q", n))
        elif q == APPEND:
            key, value = _recv_bytes(conn).decode(), _recv_bytes(conn)
            with self._cond:
                self._keys[key] = self._keys.get(key, b"") + value
                self._cond.notify_all()
        elif q == MULTI_GET:
            keys = [_recv_bytes(conn).decode() for _ in range(_recv_u64(conn))]
            with self._cond:
                values = [self._keys.get(k) for k in keys]
            if any(v is None for v in values):
                raise EOFError
            conn.sendall(b"".join(_vector(v) for v in values if v is not None))
        elif q == MULTI_SET:
            for _ in range(_recv_u64(conn)):
                key, value = _recv_bytes(conn).decode(), _recv_bytes(conn)
                self.set(key, value)
        else:  # queues, key listing, barriers: no vLLM 0.33 worker asks for them
            raise EOFError


_PLAIN = frozenset({"dict", "list", "tuple", "str", "bytes", "int", "float", "bool", "NoneType"})


class _PlainUnpickler(pickle.Unpickler):
    """Builds plain data only: a pickle that names any class or function is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise StoreError(
            f"a worker's metadata envelope names {module}.{name}; only plain data is accepted "
            "on the nccl_m2n rendezvous (is something other than a vLLM worker on the port?)"
        )


def loads_plain(data: bytes) -> Any:
    """A worker's pickled envelope, refused unless it is plain data."""
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except StoreError:
        raise
    except Exception as exc:
        raise StoreError(f"a worker's metadata envelope does not unpickle: {exc}") from exc


class MetadataGroup:
    """The trainer ranks' side of vLLM's ``StatelessProcessGroup`` key scheme, on a
    ``MetadataStore``.

    ``world_size`` counts every rank (the trainer ranks, then the workers); this process
    speaks for trainer ranks ``[0, own)`` (one process driving all of its local devices'
    ranks publishes each one's envelope, as vLLM's trainer ranks would each publish theirs).
    """

    def __init__(
        self,
        store: MetadataStore,
        world_size: int,
        *,
        timeout_s: float,
        own: int = 1,
        check: Callable[[], None] | None = None,
    ) -> None:
        if not 1 <= own < world_size:
            raise ValueError(f"own ranks {own} must leave a worker in world size {world_size}")
        self.store, self.world_size, self.timeout_s = store, int(world_size), float(timeout_s)
        self.own, self.check = int(own), check
        self._published = dict.fromkeys(range(self.own), 0)
        self._recv = dict.fromkeys(range(self.world_size), 0)
        self._sends = dict.fromkeys(range(self.world_size), 0)
        store.set(INIT_KEY, str(self.own).encode())  # the joins torch's master would count

    def _publish(self, rank: int, obj: Any) -> None:
        n = self._published[rank]
        self.store.set(f"{KEY_PREFIX}broadcast_from/{rank}/{n}", pickle.dumps(obj))
        self._published[rank] = n + 1

    def _read(self, src: int) -> Any:
        n = self._recv[src]
        data = self.store.get(
            f"{KEY_PREFIX}broadcast_from/{src}/{n}",
            deadline=time.monotonic() + self.timeout_s,
            what=f"rank {src}'s envelope",
            check=self.check,
        )
        self._recv[src] = n + 1
        return loads_plain(data)

    def all_gather_obj(self, obj: Any) -> list[Any]:
        """Every rank's envelope, in rank order; ``obj`` is each own rank's (a key is written
        once and read by every rank, so publishing all of ours first is the same exchange)."""
        for r in range(self.own):
            self._publish(r, obj)
        return [obj if r < self.own else self._read(r) for r in range(self.world_size)]

    def send_obj(self, obj: Any, dst: int) -> None:
        """Rank 0's ``send_obj`` (vLLM's trainer uses it between its own ranks only)."""
        n = self._sends[dst]
        self.store.set(f"{KEY_PREFIX}send_to/{dst}/{n}", pickle.dumps(obj))
        self._sends[dst] = n + 1
