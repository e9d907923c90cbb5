"""The toy backend's worker init info and the file names both sides agree on."""

from __future__ import annotations

import os
from dataclasses import dataclass

from weightwire.shared.checks import check_buffer_size, check_num_buffers, check_seconds
from weightwire.shared.errors import ConfigError
from weightwire.shared.info import DEFAULT_PACKED_NUM_BUFFERS, MAX_TIMEOUT_S, StrictInfo
from weightwire.shared.limits import DEFAULT_STAGE_BUDGET_BYTES


def chunk_path(directory: str, seq: int) -> str:
    """Where broadcast number ``seq`` of the session lands (complete once it exists)."""
    return os.path.join(directory, f"{seq}.bin")


def ready_path(directory: str, rank: int) -> str:
    """The file worker ``rank`` writes once it joined (rank 0's rendezvous waits for it)."""
    return os.path.join(directory, f"ready.{rank}")


@dataclass(frozen=True, kw_only=True, repr=False)
class ToyFilesInitInfo(StrictInfo):
    """``toy_files``: the directory rank 0 writes chunks into, plus the wire params."""

    dir: str
    rank_offset: int
    world_size: int
    packed: bool = True
    packed_buffer_size_bytes: int = 1 << 20
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS
    timeout_s: float = 30.0
    stage_budget_bytes: int = DEFAULT_STAGE_BUDGET_BYTES

    def __post_init__(self) -> None:
        ctx = type(self).__name__
        if not os.path.isabs(self.dir):
            raise ConfigError(f"{ctx}.dir must be an absolute path, got {self.dir!r}")
        if not 1 <= self.rank_offset < self.world_size:
            raise ConfigError(
                f"{ctx}: rank_offset {self.rank_offset} must be in "
                f"[1, world_size {self.world_size})"
            )
        check_buffer_size(f"{ctx}.packed_buffer_size_bytes", self.packed_buffer_size_bytes)
        check_num_buffers(f"{ctx}.packed_num_buffers", self.packed_num_buffers)
        check_seconds(f"{ctx}.timeout_s", self.timeout_s, most=MAX_TIMEOUT_S)
