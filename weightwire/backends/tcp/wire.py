"""Wire format of the ``weightwire_tcp`` data plane, and the socket loops that move it.

All integers are big-endian. One TCP connection per receiver, opened by the receiver
to the sender (rank 0), which listens at ``host:port`` from ``TCPInitInfo``.

Handshake (proves the 128-byte shared secret in both directions; the secret itself
never crosses the wire, only HMAC-SHA256 tags over fresh random nonces)::

    sender  -> receiver  HELLO    40 B  "WWTC" | version u32 | server_nonce 32 B
    receiver -> sender   AUTH     76 B  "WWAU" | rank u32 | world_size u32 |
                                        client_nonce 32 B | client_tag 32 B
    sender  -> receiver  VERDICT  40 B  "WWVD" | code u32 | server_tag 32 B
                                        (code != 0: refused, tag all zeros, sender closes)
    receiver -> sender   frame "WWOK"   the receiver accepted the sender's proof

    client_tag = HMAC-SHA256(secret, "weightwire/tcp/v1/client" | server_nonce | client_nonce
                             | rank | world_size)
    server_tag = HMAC-SHA256(secret, "weightwire/tcp/v1/server" | client_nonce | server_nonce
                             | rank | world_size)

The sender checks the client tag before anything else (so an unauthenticated peer
learns nothing but "wrong secret"), then the rank (in ``[1, world_size)``, not yet
taken) and world size. Verdict codes are ``REFUSALS`` below.

After the handshake every message starts with a 16-byte frame header::

    tag 4 B | seq u32 | length u64

    "WWRD" receiver -> sender   warm-up: ready (seq 0, length 0)
    "WWGO" sender -> receiver   warm-up: go, every receiver is ready (seq 0, length 0)
    "WWBC" sender -> receiver   broadcast number ``seq`` (0, 1, 2, ... mod 2**32 per
                                connection), followed by exactly ``length`` payload bytes
    "WWSL" sender -> receiver   a sliced round's frame number ``seq`` (0, 1, ... within one
                                update) on this receiver's link only, followed by ``length``
                                bytes: its pieces' headers, then their bytes
                                (``tcp.slices``)

A receiver's ready frame may carry a payload (``length`` bytes after the header): its hello,
the JSON of its wants when the init info asked for them (``sliced``); an empty ready is a
receiver that wants every tensor whole.

The payload is the root's buffer bytes, unframed; a list of parts is sent back to back
as one payload. A receiver compares tag, seq and length against what it expects
before writing a single payload byte into its buffer, so a desynchronized stream (the
two sides disagree on the framing plan) fails with a ``TransferError`` naming both
values instead of loading misaligned weights. There is no per-broadcast
acknowledgement: the control plane's ``/update_weights`` response reports what
landed, and a receiver that fails closes its socket, which the sender sees on its
next send.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import math
import secrets
import socket
import struct
import time
from collections.abc import Sequence

import numpy as np

from weightwire.shared.errors import PeerLost, TransferError, TransferTimeout, WeightwireError
from weightwire.shared.info import TCP_SECRET_BYTES

PROTOCOL_VERSION = 1
NONCE_BYTES = 32

HELLO = struct.Struct("!4sI32s")
AUTH = struct.Struct("!4sII32s32s")
VERDICT = struct.Struct("!4sI32s")
FRAME = struct.Struct("!4sIQ")

HELLO_MAGIC = b"WWTC"
AUTH_MAGIC = b"WWAU"
VERDICT_MAGIC = b"WWVD"
TAG_CONFIRM = b"WWOK"
TAG_READY = b"WWRD"
TAG_GO = b"WWGO"
TAG_BROADCAST = b"WWBC"
TAG_SLICE = b"WWSL"
MAX_HELLO_BYTES = 64 << 20
"""A hello's bound: a wants JSON is a few hundred bytes per tensor."""

OK = 0
BAD_SECRET = 1
BAD_RANK = 2
DUPLICATE_RANK = 3
WORLD_SIZE_MISMATCH = 4
CLOSED = 5
REFUSALS: dict[int, str] = {
    BAD_SECRET: "wrong secret (the receiver's HMAC did not match)",
    BAD_RANK: "rank out of range",
    DUPLICATE_RANK: "rank already connected",
    WORLD_SIZE_MISMATCH: "world_size differs from the sender's",
    CLOSED: "the rendezvous is no longer accepting",
}

DEFAULT_SOCKET_BUFFER_BYTES: int | None = 4 << 20
"""Minimum kernel send/receive buffer per data socket (see ``tune``; ``None``: leave as is)."""

_CLIENT_LABEL = b"weightwire/tcp/v1/client"
_SERVER_LABEL = b"weightwire/tcp/v1/server"
_IOV_BATCH = 64  # well under IOV_MAX (1024 on Linux and macOS)
# A dead peer must surface as EPIPE, not kill an embedding process that restored SIGPIPE.
_SEND_FLAGS = getattr(socket, "MSG_NOSIGNAL", 0)


def client_tag(
    secret: bytes, server_nonce: bytes, client_nonce: bytes, rank: int, world_size: int
) -> bytes:
    msg = _CLIENT_LABEL + server_nonce + client_nonce + struct.pack("!II", rank, world_size)
    return hmac.new(secret, msg, hashlib.sha256).digest()


def server_tag(
    secret: bytes, client_nonce: bytes, server_nonce: bytes, rank: int, world_size: int
) -> bytes:
    msg = _SERVER_LABEL + client_nonce + server_nonce + struct.pack("!II", rank, world_size)
    return hmac.new(secret, msg, hashlib.sha256).digest()


def frame(tag: bytes, seq: int = 0, length: int = 0) -> bytes:
    return FRAME.pack(tag, seq & 0xFFFFFFFF, length)


class WireShort(WeightwireError):
    """A socket loop stopped early: ``offset`` bytes had moved; ``timed_out`` or ``cause``."""

    def __init__(self, offset: int, *, timed_out: bool = False, cause: str = "") -> None:
        super().__init__(offset, timed_out, cause)
        self.offset = offset
        self.timed_out = timed_out
        self.cause = cause


ByteView = memoryview | np.ndarray
"""A flat ``uint8`` host buffer: what ``sendmsg`` / ``recv_into`` take, ``len`` its bytes,
a slice the rest of it."""


def byte_view(obj: object, *, writable: bool) -> ByteView:
    """A flat ``uint8`` view of a host buffer, without copying: a numpy array's own
    ``uint8`` view (the socket calls take it as it is: no memoryview, whose two
    GC-tracked objects per tensor a delta round's hundreds of wire tensors made objects
    its young collections promoted towards a full one, #49), else a ``memoryview``.

    Refuses non-contiguous or (for receiving) read-only buffers instead of silently
    sending from / receiving into a temporary copy.
    """
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError(
                f"buffer must be C-contiguous, got a strided array of shape {obj.shape}"
            )
        if writable and not obj.flags.writeable:
            raise ValueError("receive buffer is read-only (ndarray); pass a writable array")
        # via uint8: memoryview cannot export ml_dtypes (bfloat16, float8) formats
        return obj.reshape(-1).view(np.uint8)
    try:
        view = memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(
            "TCP buffers must be host memory (numpy array, memoryview, bytes-like), "
            f"got {type(obj).__name__}; "
            "copy device arrays to the host first"
        ) from None
    if not view.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    if writable and view.readonly:
        raise ValueError(
            f"receive buffer is read-only ({type(obj).__name__}); pass a writable array"
        )
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


def byte_views(buffer: object, *, writable: bool) -> list[ByteView]:
    """One logical buffer as its list of parts (a single buffer is a list of one)."""
    parts = buffer if isinstance(buffer, (list, tuple)) else [buffer]
    return [byte_view(part, writable=writable) for part in parts]


def send_all(
    sock: socket.socket, views: Sequence[ByteView], deadline: float, progress: list[int]
) -> None:
    """Send ``views`` back to back by ``deadline`` (``time.monotonic``), zero-copy.

    ``sendmsg`` gathers header and parts into one syscall without concatenating them.
    ``progress[0]`` counts bytes handed to the kernel, for error messages.
    """
    pending = [v for v in views if len(v)]
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise WireShort(progress[0], timed_out=True)
        try:
            sock.settimeout(remaining)
            # numpy arrays export the buffer protocol; their stubs do not say so
            sent = sock.sendmsg(pending[:_IOV_BATCH], (), _SEND_FLAGS)  # type: ignore[arg-type]
        except TimeoutError:
            raise WireShort(progress[0], timed_out=True) from None
        except OSError as exc:
            raise WireShort(progress[0], cause=_describe(exc)) from None
        progress[0] += sent
        while sent:
            head = len(pending[0])
            if sent >= head:
                sent -= head
                pending.pop(0)
            else:
                pending[0] = pending[0][sent:]
                sent = 0


def recv_into(
    sock: socket.socket, view: ByteView, deadline: float, progress: list[int] | None = None
) -> None:
    """Fill ``view`` exactly by ``deadline``; EOF, reset or timeout raise ``WireShort``."""
    total = len(view)
    got = 0
    base = progress[0] if progress is not None else 0
    while got < total:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise WireShort(base + got, timed_out=True)
        try:
            sock.settimeout(remaining)
            n = sock.recv_into(view[got:], total - got)  # type: ignore[arg-type]
        except TimeoutError:
            raise WireShort(base + got, timed_out=True) from None
        except OSError as exc:
            raise WireShort(base + got, cause=_describe(exc)) from None
        if n == 0:
            raise WireShort(base + got, cause="connection closed by peer")
        got += n
        if progress is not None:
            progress[0] = base + got


def recv_exact(sock: socket.socket, nbytes: int, deadline: float) -> bytes:
    buf = bytearray(nbytes)
    recv_into(sock, memoryview(buf), deadline)
    return bytes(buf)


def tune(sock: socket.socket, buffer_bytes: int | None) -> None:
    """TCP_NODELAY (frames are small and latency-bound), and kernel buffers of at least
    ``buffer_bytes`` each way.

    An explicit SO_SNDBUF/SO_RCVBUF turns Linux's buffer autotuning off and is capped
    at ``net.core.[rw]mem_max``, so it is only set where autotuning could not reach
    ``buffer_bytes`` by itself. On loopback (2-core host) autotuning moved 1 GiB at
    ~2.8 GB/s against ~2.3 GB/s with a fixed 4 MiB. ``None`` never touches them.
    """
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if buffer_bytes:
        buffer_bytes = min(
            buffer_bytes, 0x7FFFFFFF
        )  # a C int; the kernel caps it at [rw]mem_max anyway
        if _autotune_ceiling("tcp_wmem") < buffer_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_bytes)
        if _autotune_ceiling("tcp_rmem") < buffer_bytes:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_bytes)


@functools.cache
def _autotune_ceiling(name: str) -> int:
    """Largest buffer Linux autotuning may grow a socket to (0 where unknown: not Linux)."""
    try:
        with open(f"/proc/sys/net/ipv4/{name}") as f:
            return int(f.read().split()[2])
    except (OSError, ValueError, IndexError):
        return 0


def shutdown_quietly(sock: socket.socket) -> None:
    """Shut both directions down, waking any thread blocked on the socket; never raises."""
    with contextlib.suppress(OSError):  # already reset or closed by the peer
        sock.shutdown(socket.SHUT_RDWR)


def _describe(exc: OSError) -> str:
    return f"{type(exc).__name__}: {exc.strerror or exc}"


def positive_seconds(name: str, value: float) -> float:
    """``value`` as seconds; ``ValueError`` naming ``name`` unless a finite number > 0."""
    if not (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    ):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def check_secret(secret: object) -> bytes:
    """``secret`` if it is exactly ``TCP_SECRET_BYTES`` bytes; ``ValueError`` otherwise."""
    if not isinstance(secret, bytes) or len(secret) != TCP_SECRET_BYTES:
        size = len(secret) if isinstance(secret, bytes) else type(secret).__name__
        raise ValueError(f"secret must be exactly {TCP_SECRET_BYTES} bytes, got {size}")
    return secret


def dial(host: str, port: int, deadline: float, buffer_bytes: int | None) -> socket.socket:
    """Connect to ``host:port``, retrying refused connections until ``deadline``.

    Refusals are retried because the sender may be starting.
    """
    last = "no address"
    while True:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise TransferError(f"cannot resolve TCP sender {host}:{port}: {exc}") from None
        for family, kind, proto, _, addr in infos:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            sock = socket.socket(family, kind, proto)
            try:
                tune(sock, buffer_bytes)  # before connect: the window scale is fixed by the SYN
                sock.settimeout(remaining)
                sock.connect(addr)
                return sock
            except OSError as exc:
                sock.close()
                last = f"{type(exc).__name__}: {exc}"
        if time.monotonic() + 0.05 >= deadline:
            raise TransferTimeout(
                f"could not connect to the TCP sender at {host}:{port} in time ({last})"
            )
        time.sleep(0.05)


def client_handshake(
    sock: socket.socket, secret: bytes, rank: int, world_size: int, deadline: float, where: str
) -> None:
    """A receiver's half of the handshake on a dialed socket: check the sender's hello,
    prove the secret, verify the sender's proof, confirm; bounded by ``deadline``."""
    try:
        magic, version, server_nonce = HELLO.unpack(recv_exact(sock, HELLO.size, deadline))
        if magic != HELLO_MAGIC or version != PROTOCOL_VERSION:
            raise TransferError(
                f"{where} is not a weightwire TCP sender of protocol v{PROTOCOL_VERSION}"
            )
        client_nonce = secrets.token_bytes(NONCE_BYTES)
        tag = client_tag(secret, server_nonce, client_nonce, rank, world_size)
        auth = AUTH.pack(AUTH_MAGIC, rank, world_size, client_nonce, tag)
        send_all(sock, [memoryview(auth)], deadline, [0])
        magic, code, proof = VERDICT.unpack(recv_exact(sock, VERDICT.size, deadline))
        if magic != VERDICT_MAGIC:
            raise TransferError(f"{where} answered the handshake with garbage")
        if code != OK:
            reason = REFUSALS.get(code, f"code {code}")
            raise TransferError(f"{where} refused rank {rank} (world_size {world_size}): {reason}")
        expected = server_tag(secret, client_nonce, server_nonce, rank, world_size)
        if not hmac.compare_digest(proof, expected):  # constant time
            raise TransferError(
                f"{where} did not prove the shared secret; refusing to receive weights from it"
            )
        send_all(sock, [memoryview(frame(TAG_CONFIRM))], deadline, [0])
    except WireShort as short:
        if short.timed_out:
            raise TransferTimeout(
                f"TCP handshake with {where} did not finish in time (is the sender in accept()?)"
            ) from None
        raise PeerLost(f"lost {where} during the handshake: {short.cause}") from None
