"""``MultiSourceLink``: one receive link per broadcasting trainer rank (TCP).

With several broadcasters each one is the root of its own TCP star, so a worker holds
one link per ``src``; a turn's update info names its ``src`` and the round receives on
that link only. Failure rule: any error aborts every link (a half-read stream from one
broadcaster makes the whole round unusable, and the trainer must re-initialize).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from weightwire.shared.framing import Chunk
from weightwire.shared.meta import ParamMeta
from weightwire.torch_side.worker.receive import ReceiveLink


class MultiSourceLink(ReceiveLink):
    def __init__(self, links: Sequence[ReceiveLink]) -> None:
        first = links[0]
        super().__init__(None, device=first.device, timeout_s=first.timeout_s, depth=first.depth)
        self.links = list(links)

    def for_src(self, src: int) -> ReceiveLink:
        if not 0 <= src < len(self.links):
            raise ValueError(f"update info names src {src}, but the init info listed {len(self.links)} "
                             f"broadcasting trainer rank(s): src must be in [0, {len(self.links)})")
        return self.links[src]

    def post(self, index: int, chunk: Chunk, metas: Sequence[ParamMeta], *, packed: bool) -> None:
        raise RuntimeError("MultiSourceLink receives through for_src(src)")

    def wait(self, index: int) -> torch.Tensor:
        raise RuntimeError("MultiSourceLink receives through for_src(src)")

    def abort(self) -> None:
        for link in self.links:
            link.abort()

    def close(self) -> None:
        for link in self.links:
            link.close()
