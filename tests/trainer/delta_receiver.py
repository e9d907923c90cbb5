"""An in-test worker for delta rounds: reads the update info and the fake communicator's
broadcasts of each round, applies dense tensors then patches with numpy (the reference,
``shared.delta.apply_patch``) at finish, remembers the committed round's token, and
refuses a delta round built on another base with ``DeltaBaseMismatch`` (as a server's
error text), before using any byte."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from tests.trainer.fakes import FAKE, FakeComm, FakeServer
from weightwire.shared.delta import apply_patch
from weightwire.shared.errors import DeltaBaseMismatch
from weightwire.shared.framing import plan, unpack_host
from weightwire.shared.meta import ParamMeta
from weightwire.shared.update_info import UpdateInfo


class DeltaReceiver:
    def __init__(self, server: FakeServer, weights: dict[str, np.ndarray]) -> None:
        self.server = server
        self.weights = {n: np.array(a, copy=True) for n, a in weights.items()}
        self.token: str | None = None
        self.infos: list[UpdateInfo] = []
        self.refused = 0
        self._metas: list[ParamMeta] = []
        self._comm: FakeComm | None = None
        self._start = 0
        self._info: UpdateInfo | None = None
        server.hooks["start_weight_update"] = self._on_start
        server.hooks["update_weights"] = self._on_update
        server.hooks["finish_weight_update"] = self._on_finish

    def restart(self) -> None:
        """A worker restart: same weights, no remembered round."""
        self.token = None

    def _on_start(self, body: Any) -> None:
        self._comm, self._start = FAKE.comm, len(FAKE.comm.broadcasts)

    def _on_update(self, body: Any) -> None:
        info = UpdateInfo.from_dict(body["update_info"])
        self.infos.append(info)
        self.server.fail.pop("update_weights", None)
        if info.delta_base is not None and info.delta_base != self.token:
            self.refused += 1
            error = DeltaBaseMismatch(info.delta_base, self.token)
            self.server.fail["update_weights"] = (500, f"WeightReceiveError: {error}")
            FAKE.comm = FakeComm()  # the trainer's reopened wire gets a fresh communicator
            self._info = None
            return
        self._info = info

    def _on_finish(self, body: Any) -> None:
        info = self._info
        assert info is not None and self._comm is not None
        metas = info.metas() if not info.reuses_previous else self._metas
        self._metas = metas
        chunks = plan(metas, packed=True, buffer_size_bytes=1 << 30)
        raw = self._comm.broadcasts[self._start :]
        assert len(raw) == len(chunks)
        got: dict[str, np.ndarray] = {}
        for chunk, data in zip(chunks, raw, strict=True):
            got.update(unpack_host(np.frombuffer(data, np.uint8), metas, chunk))
        patched = {p.name for p in info.patch_list()}
        for name, array in got.items():
            if name.rpartition("@")[0] not in patched:
                assert name in self.weights, name
                self.weights[name] = array
        for p in info.patch_list():
            index, values = got[p.index_name], got[p.values_name]
            assert np.all(np.diff(index.astype(np.int64)) > 0)
            self.weights[p.name] = apply_patch(self.weights[p.name], index, values)
        self.token = info.round_token
        self._info = None
        self.server.checksums = {  # what /weight_checker reports: sha256 of each whole tensor
            n: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
            for n, a in self.weights.items()
        }
