"""``weightwire_tcp``'s sliced-round wire: hellos on the warm-up, one receiver's frames, and
the checks a receiver makes on a frame before it takes a byte of it."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from tcp_pairs import joined

from weightwire.backends.tcp import wire
from weightwire.backends.tcp.slices import frame_header, parse_frame, piece_header
from weightwire.shared.errors import TransferError
from weightwire.shared.meta import ParamMeta
from weightwire.shared.slices import Box

METAS = [ParamMeta("a", "float32", (4, 3)), ParamMeta("b", "bfloat16", (5,))]


def test_each_receivers_hello_reaches_the_root_and_frames_reach_only_their_receiver() -> None:
    root, (one, two) = joined(3, hellos=[b'{"wants": 1}', b""])
    try:
        assert root.hellos == {1: b'{"wants": 1}', 2: b""}
        payload = [frame_header(1, True), piece_header(0, Box.of((1, 2), (0, 3)))]
        with ThreadPoolExecutor(1) as pool:
            got = pool.submit(one.recv_frame, seq=0, max_bytes=1 << 10, timeout=10)
            assert root.send_frame(1, payload, seq=0, timeout=10) == sum(map(len, payload))
            assert got.result(timeout=10) == b"".join(payload)
        assert not two.peer_closed() and not one.peer_closed()  # nothing else on the wires
    finally:
        for c in (root, one, two):
            c.close()


def test_an_oversized_hello_fails_the_warm_up_naming_the_peer(monkeypatch) -> None:
    monkeypatch.setattr(wire, "MAX_HELLO_BYTES", 8)
    with pytest.raises(TransferError, match=r"rank 1 .* sent a 9-byte hello, over the 8-byte"):
        joined(2, hellos=[b"123456789"])


def test_a_frame_over_its_bound_or_out_of_order_is_refused_before_its_bytes() -> None:
    root, (one,) = joined(2, hellos=[b""])
    try:
        with ThreadPoolExecutor(1) as pool:
            got = pool.submit(one.recv_frame, seq=0, max_bytes=4, timeout=10)
            root.send_frame(1, [b"12345"], seq=0, timeout=10)
            with pytest.raises(TransferError, match=r"sliced frame #0 .* is 5 bytes, over the 4"):
                got.result(timeout=10)
    finally:
        root.close()
        one.close()
    root, (one,) = joined(2, hellos=[b""])
    try:
        with ThreadPoolExecutor(1) as pool:
            got = pool.submit(one.recv_frame, seq=0, max_bytes=64, timeout=10)
            root.send_frame(1, [b"1"], seq=3, timeout=10)
            with pytest.raises(TransferError, match="expected broadcast #0 .*, got #3"):
                got.result(timeout=10)
    finally:
        root.close()
        one.close()


def frame(pieces: list[tuple[int, Box, bytes]], last: bool = True) -> bytes:
    head = frame_header(len(pieces), last) + b"".join(piece_header(t, b) for t, b, _ in pieces)
    out = head + bytes(-len(head) % 8)
    for _, _, data in pieces:
        out += data + bytes(-len(data) % 8)
    return out


def test_a_frames_pieces_are_checked_against_the_updates_tensors() -> None:
    a = np.arange(6, dtype=np.float32).tobytes()
    b = bytes(4)  # two bfloat16
    pieces, last = parse_frame(
        frame([(0, Box.of((0, 2), (0, 3)), a), (1, Box.of((3, 5)), b)]), METAS, "test"
    )
    assert last and [(p.tensor, p.box, p.nbytes) for p in pieces] == [
        (0, Box.of((0, 2), (0, 3)), 24),
        (1, Box.of((3, 5)), 4),
    ]
    assert all(p.offset % 8 == 0 for p in pieces)  # each piece viewable in its dtype
    bad = {
        "names tensor #2; the update lists 2": frame([(2, Box.of((0, 1)), bytes(4))]),
        r"'a' is box \[3:5, 0:3\], empty or outside": frame([(0, Box.of((3, 5), (0, 3)), a)]),
        r"'b' is box \[2:2\], empty": frame([(1, Box.of((2, 2)), b"")]),
        "pieces take 40 bytes, the frame has 48": frame([(1, Box.of((0, 2)), bytes(12))]),
        "ends inside its piece headers": frame_header(2, True) + piece_header(0, Box.of((0, 1))),
    }
    for match, payload in bad.items():
        with pytest.raises(TransferError, match=match):
            parse_frame(payload, METAS, "test")
