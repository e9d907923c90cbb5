"""A worker core (``_ReceiverCore``) on the CPU over a test model and a test link, and the
TCP init info that opens its session: the set-up of the core-level tests, written once."""

from __future__ import annotations

from typing import Any

import torch

from weightwire.backends.tcp.info import TCPInitInfo
from weightwire.shared.info import encode_secret
from weightwire.torch_side.worker.core import _ReceiverCore


def local_core(model: Any, connect: Any, **options: Any) -> _ReceiverCore:
    """A core that loads into ``model`` and opens its links with ``connect`` (the core's
    own signature: ``connect(info, *, rank, device)``); ``options`` go to the core as they are."""
    return _ReceiverCore(
        backend="test",
        device=torch.device("cpu"),
        target=lambda: (model, None),
        connect=connect,
        info_type=TCPInitInfo,
        **options,
    )


def local_init(**fields: Any) -> TCPInitInfo:
    """Rank 1 of 2 with a fixed secret: nothing dials the address, the link is the test's."""
    return TCPInitInfo(
        host="127.0.0.1",
        port=1,
        secret_b64=encode_secret(b"s" * 128),
        rank_offset=1,
        world_size=2,
        **fields,
    )
