"""``TorchStoreGroup``: a ``trainer.group.TrainerGroup`` over torch.distributed's store.

The c10d store (the ``TCPStore`` behind ``init_process_group``) is what the ranks
already rendezvoused through; reading it is bounded by a timeout, unlike a gloo
collective with a dead peer. Pass ``store`` explicitly, or let it take the default
process group's.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any

import torch.distributed as dist

from weightwire.shared.errors import NotInitialized
from weightwire.trainer.group import StoreGroup

_DEFAULT_STORE = object()  # the default process group's store, however many wrappers of it we hold


class TorchStoreGroup(StoreGroup):
    def __init__(
        self, store: Any = None, *, rank: int | None = None, size: int | None = None
    ) -> None:
        if store is None:
            if not dist.is_initialized():
                raise NotInitialized(
                    "TorchStoreGroup needs a store, or torch.distributed.init_process_group first"
                )
            store = dist.distributed_c10d._get_default_store()
            identity: object = (
                _DEFAULT_STORE  # each lookup may return a fresh wrapper of the same store
            )
        else:
            identity = store
        super().__init__(
            dist.get_rank() if rank is None else rank,
            dist.get_world_size() if size is None else size,
        )
        self._store, self._identity = store, identity
        self._beat_store: Any = None
        self._beat_lock = threading.Lock()

    @property
    def store(self) -> object:
        return self._identity

    def _set(self, key: str, value: str) -> None:
        self._store.set(key, value)

    def _get(self, key: str, timeout: float) -> str:
        # torch raises DistStoreError / RuntimeError variants on timeout:
        # StoreGroup.read names the key (a timed-out wait leaves the connection usable, which
        # a long wait's polling after its first read of a beat relies on)
        self._store.wait([key], datetime.timedelta(seconds=timeout))
        return bytes(self._store.get(key)).decode()

    def _put(self, key: str, value: str) -> None:
        # The beat thread's own connection: a TCPStore client serves one call at a time, so
        # on the shared one a beat would queue behind the main thread's blocking wait (or a
        # user's own store.wait) and read as a stopped rank.
        with self._beat_lock:
            if self._beat_store is None:
                try:
                    self._beat_store = self._store.clone()
                except Exception:  # a store without clone(): beat over the shared client
                    self._beat_store = self._store
        self._beat_store.set(key, value)

    def _peek(self, key: str) -> str | None:
        if not self._store.check([key]):
            return None
        return bytes(self._store.get(key)).decode()
