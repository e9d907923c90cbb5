"""The trainer's end of ``weightwire_ipc``: rendezvous and data path (rank 0).

``IPCRendezvous`` allocates the slots and their ready events, exports the handles
(for the init info) and listens on loopback; ``join`` accepts every worker, reads its
hello (rank, free-event handles, GPU, the modes it takes), opens those events and
tells every worker the session's mode.

Mode (``choose_mode``): ``write_through`` (the trainer copies each tensor straight into
the workers' serving parameters, ``backends.ipc.through``; a worker whose loader is not
a plain copy takes its rounds as in pull), ``pull`` (the trainer copies straight into the
workers' receive buffers, ``backends.ipc.pull``: one device copy per byte, then the
worker loads) or ``push`` (the slot ring, ``backends.ipc.pipeline``: two copies). Pull and
write-through need packed rounds and every worker offering them; then the slots are
freed at once (only their ready events stay). ``auto`` (the default) is write-through
where every worker says in its hello that its model can take it (``cannot_write_through``:
why not, checked by the worker at join), else pull, logged once naming the worker and why;
a delta session pulls (``IPCBackend.open``). The slots are made once per session and
reused every round (``release_after_round`` frees them between rounds instead). The
joined link is ``ipc.link.IPCSenderComm``; ``IPCBackend`` is the registry's trainer
part: it opens an ``IPCRendezvous`` and makes the mode's pipeline the round's data path.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Sequence
from contextlib import suppress
from typing import Any, ClassVar

from weightwire.backends.base import (
    Backend,
    Rendezvous,
    RoundSender,
    SenderCaps,
    SenderParts,
    SenderSettings,
)
from weightwire.backends.ipc.channel import Listener, check_int
from weightwire.backends.ipc.info import IPC_MODES, IPCInitInfo, decode_handles
from weightwire.backends.ipc.link import IPCSenderComm
from weightwire.backends.ipc.options import ipc_options
from weightwire.backends.ipc.pipeline import IPCPipeline
from weightwire.backends.ipc.pull import IPCPullPipeline
from weightwire.backends.ipc.slots import (
    IPCSlots,
    cupy_module,
    device_uuid,
    ipc_available,
    ipc_unavailable,
    open_event,
)
from weightwire.backends.ipc.spec import IPC
from weightwire.backends.ipc.through.pipeline import IPCWriteThroughPipeline
from weightwire.shared.errors import ConfigError, TransferError
from weightwire.shared.info import TCP_SECRET_BYTES, encode_secret
from weightwire.shared.limits import DEFAULT_STAGE_BUDGET_BYTES

logger = logging.getLogger(__name__)


class IPCRendezvous:
    """Slots + listener for one session; ``payload`` is the worker init info."""

    def __init__(
        self,
        *,
        world_size: int,
        device: int | None,
        slot_bytes: int,
        num_slots: int,
        packed: bool,
        timeout_s: float,
        release_after_round: bool,
        bind_host: str = "127.0.0.1",
        mode: str = "push",
        stage_budget_bytes: int = DEFAULT_STAGE_BUDGET_BYTES,
    ) -> None:
        cp = cupy_module()
        self._cp = cp
        self.device = int(cp.cuda.runtime.getDevice()) if device is None else int(device)
        self.world_size = world_size
        self._secret = secrets.token_bytes(TCP_SECRET_BYTES)
        self.slots = IPCSlots(cp, self.device, slot_bytes, num_slots)
        self._release = release_after_round
        self._asked, self._packed = mode, packed
        try:
            self._listener = Listener(bind_host, self._secret)
            host, port = self._listener.address
            self.payload = IPCInitInfo(
                host=host,
                port=port,
                secret_b64=encode_secret(self._secret),
                rank_offset=1,
                world_size=world_size,
                mem_handles_b64=self.slots.mem_handles_b64(),
                event_handles_b64=self.slots.event_handles_b64(),
                device_uuid=device_uuid(cp, self.device),
                packed=packed,
                packed_buffer_size_bytes=slot_bytes,
                packed_num_buffers=num_slots,
                timeout_s=timeout_s,
                release_after_round=release_after_round,
                stage_budget_bytes=stage_budget_bytes,
            ).to_dict()
        except BaseException:
            self.slots.destroy()
            raise
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"IPCRendezvous(device={self.device}, world_size={self.world_size}, <handles redacted>)"
        )

    def join(self, *, timeout: float) -> IPCSenderComm:
        deadline = time.monotonic() + timeout
        try:
            accepted = self._listener.accept(self.world_size - 1, timeout=timeout)
        except BaseException:
            self.cancel()
            raise
        self._close_listener()
        want = len(accepted)
        channels, frees, uuids, ranks, offers = [], [], [], set(), []
        cannot: list[tuple[str, str]] = []  # (worker, why its model cannot be written through)
        try:
            for ch in accepted:
                channels.append(ch)
                hello = ch.expect("hello", deadline=deadline, what="the worker's hello")
                rank = check_int(hello, "rank", 1, self.world_size - 1, ch.peer)
                if rank in ranks:
                    raise TransferError(f"two IPC workers claim rank {rank}")
                ranks.add(rank)
                ch.peer = f"IPC worker rank {rank}"
                handles = decode_handles(f"{ch.peer} hello.free", hello.get("free"))
                if len(handles) != self.slots.count:
                    raise TransferError(
                        f"{ch.peer} exported {len(handles)} free events "
                        f"for {self.slots.count} slots"
                    )
                with self._cp.cuda.Device(self.device):
                    frees.append(
                        [
                            open_event(self._cp, h, f"{ch.peer}'s free event {s}")
                            for s, h in enumerate(handles)
                        ]
                    )
                uuid = hello.get("uuid")
                uuids.append(uuid if isinstance(uuid, str) else "")
                offers.append(_modes(hello, ch.peer))
                why_not = _cannot_write_through(hello, ch.peer)
                if why_not is not None:
                    cannot.append((ch.peer, why_not))
            mode, why = choose_mode(self._asked, self._packed, offers, cannot=cannot)
            if why:
                logger.warning("weightwire_ipc: mode %s: %s", mode, why)
            for ch in channels:
                # "early": this trainer takes buffers named at the round's start (ipc.pull)
                ch.send({"op": "mode", "mode": mode, **({"early": True} if mode == "pull" else {})})
            if mode != "push":
                self.slots.free_memory()  # no worker opened them; the ready events stay
        except BaseException:
            for ch in accepted:
                ch.abort()
            self.slots.destroy()
            raise
        order = sorted(range(len(channels)), key=lambda k: channels[k].peer)
        comm = IPCSenderComm(
            self._cp,
            self.slots,
            [channels[k] for k in order],
            [frees[k] for k in order],
            [uuids[k] for k in order],
            self._release,
            mode,
        )
        logger.info(
            "IPC rendezvous: %d worker(s) joined; mode %s; same GPU: %s", want, mode, comm.same_gpu
        )
        return comm

    def _close_listener(self) -> None:
        self._closed = True
        with suppress(Exception):
            self._listener.close()

    def cancel(self) -> None:
        """The init POST failed or the join timed out: stop listening, free the slots."""
        self._close_listener()
        self.slots.destroy()


class IPCBackend(Backend):
    """``weightwire_ipc``: trainer and workers on one host (same GPU or peer GPUs), CUDA IPC.

    Rank 0 allocates the slot ring, exports its memory and ready-event handles in the
    init info (JSON, base64) and listens on loopback for the workers' control channels."""

    name: ClassVar[str] = IPC.name
    caps: ClassVar[SenderCaps] = SenderCaps(on_device=True)

    def check_config(self, settings: SenderSettings, *, delta: str) -> None:
        mode = ipc_options(settings, self.name).ipc_mode
        if delta != "off" and mode == "write_through":
            # A written-through round is one device copy into the serving parameters: nothing
            # for a delta to save, and patches have no place in the landing table.
            raise ConfigError(
                f"delta={delta!r} with ipc_mode={mode!r}: delta rounds over "
                f"{self.name} go through its pull path; set ipc_mode='auto' or 'pull' (a "
                "written-through dense round is already one device copy)"
            )

    def check_host(self) -> None:
        if not ipc_available():
            raise ipc_unavailable(self.name)

    def open(self, info: SenderSettings, *, world_size: int) -> Rendezvous:
        options = ipc_options(info, self.name)
        mode = session_mode(options.ipc_mode, options.delta)
        self.check_host()
        rdv = IPCRendezvous(
            world_size=world_size,
            device=info.device,
            slot_bytes=info.packed_buffer_size_bytes,
            num_slots=info.packed_num_buffers,
            packed=info.packed,
            timeout_s=float(info.timeouts.transfer_s),
            release_after_round=options.ipc_release_after_round,
            mode=mode,
            stage_budget_bytes=info.stage_budget_bytes,
        )
        return _PendingIPC(rdv.payload, rdv)

    def sender(self, link: Any, settings: SenderSettings, parts: SenderParts) -> RoundSender:
        assert isinstance(link, IPCSenderComm) and parts.packer is not None
        if link.mode != "push" and not settings.packed:
            raise TransferError(
                f"weightwire_ipc {link.mode} mode carries packed rounds only (the session "
                "negotiated push otherwise)"
            )
        pipeline = {
            "pull": IPCPullPipeline,
            "write_through": IPCWriteThroughPipeline,
        }.get(link.mode, IPCPipeline)
        return pipeline(link, parts.packer, timeout=settings.timeouts.transfer_s)


def session_mode(asked: str, delta: str) -> str:
    """The mode the rendezvous negotiates for ``asked``: ``auto`` in a delta session is pull
    (a delta round's patches go through the receive buffers; said once, here)."""
    if asked == "auto" and delta != "off":
        logger.info(
            "weightwire_ipc: ipc_mode='auto' with delta=%r: rounds take the pull path "
            "(patches land in the workers' receive buffers, not through the landing map)",
            delta,
        )
        return "pull"
    return asked


def choose_mode(
    asked: str,
    packed: bool,
    offers: list[list[str]],
    *,
    cannot: Sequence[tuple[str, str]] = (),
) -> tuple[str, str | None]:
    """The session's mode for ``asked`` (``TrainerInitInfo.ipc_mode``) given every worker's
    offer, and why it is not the one asked for (None when it is, or ``auto`` found its
    best among workers that predate write-through). ``auto``: write-through where every
    worker takes it, else pull; ``cannot``: ``(worker, why)`` for each worker whose hello
    said its model cannot be written through (``auto`` then pulls and says so; an explicit
    ``write_through`` is kept, and such a worker's rounds go through its receive buffers,
    as a worker refusing its landing table's round does)."""
    if not packed:
        return "push", None if asked == "push" else "unpacked rounds go through the slot ring"
    if asked == "push":
        return "push", None
    everyone = all("write_through" in o for o in offers)
    if asked == "write_through" and everyone:
        return "write_through", None
    if asked == "auto" and everyone and not cannot:
        return "write_through", None
    older = "a worker does not offer it (an older weightwire)"
    if all("pull" in o for o in offers):
        if asked == "write_through":
            return "pull", f"write-through asked for, but {older}"
        if asked == "auto" and cannot:
            named = "; ".join(f"{peer} cannot take it: {why}" for peer, why in cannot)
            return "pull", f"ipc_mode='auto' pulls, not write-through: {named}"
        return "pull", None
    return "push", f"{asked} asked for, but {older}"


def _modes(hello: dict[str, Any], peer: str) -> list[str]:
    """The modes a worker's hello offers (at least one)."""
    offer = hello.get("modes")
    if (
        not isinstance(offer, list)
        or not 1 <= len(offer) <= 8
        or not all(isinstance(m, str) for m in offer)
    ):
        raise TransferError(
            f"{peer} sent hello.modes {str(offer)[:80]}, not a short list of mode names "
            f"(known: {', '.join(IPC_MODES)})"
        )
    return [
        m for m in offer if m in IPC_MODES
    ]  # a later worker's modes this trainer does not know: ignored


_WHY_CHARS = 500
"""The longest reason a worker's hello may give (a landing-map refusal names one tensor)."""


def _cannot_write_through(hello: dict[str, Any], peer: str) -> str | None:
    """Why a worker's model cannot be written through, as its hello says (None: it can, or
    its weightwire predates the field and decides per round)."""
    why = hello.get("cannot_write_through")
    if why is None:
        return None
    if not isinstance(why, str) or not why:
        raise TransferError(
            f"{peer} sent hello.cannot_write_through {str(why)[:80]}, not a reason (a string)"
        )
    return why[:_WHY_CHARS]


class _PendingIPC(Rendezvous):
    """The engine's view of an ``IPCRendezvous`` (payload posted, join pending)."""

    def __init__(self, payload: dict[str, Any], rdv: IPCRendezvous) -> None:
        super().__init__(payload)
        self._rdv = rdv

    def join(self, *, timeout: float) -> IPCSenderComm:
        return self._rdv.join(timeout=timeout)

    def cancel(self) -> None:
        self._rdv.cancel()
