"""Init info: the JSON body of ``/init_weight_transfer_engine``, parsed strictly on both
sides; ``StrictInfo`` is the strict parser every info (each backend's init info, in
``backends/<name>/info.py``, and ``UpdateInfo``, in ``shared.update_info``) is built on, and
the checks the backends' infos share (wire params, a listener's endpoint and secret).

Every parser rejects unknown keys, wrong types and out-of-limit values with a
``ConfigError`` (a ``ValueError``) naming the field, so a malformed payload fails the
request instead of sizing a buffer, joining a wrong group or hanging a collective.
"""

from __future__ import annotations

import base64
import binascii
import json
import types
import typing
from dataclasses import MISSING, fields
from typing import Any, ClassVar, Self

from weightwire.shared.checks import check_buffer_size, check_num_buffers, check_seconds
from weightwire.shared.errors import ConfigError
from weightwire.shared.limits import LIMITS, bounded_repr
from weightwire.shared.meta import load_json
from weightwire.shared.staging import check_stage_budget

DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1 << 30
DEFAULT_PACKED_NUM_BUFFERS = 2
TCP_SECRET_BYTES = 128
"""The size of a trainer-listens, workers-dial secret (``secret_b64``; TCP and IPC)."""
MAX_TIMEOUT_S = 86_400
"""A worker's receive timeout is at most a day: a larger one is a unit mistake."""


def check_type(name: str, value: object, kind: type | tuple[type, ...], *, optional: bool) -> None:
    if value is None and optional:
        return
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int subclass: an int field given true/false is a caller bug.
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if float in kinds and isinstance(value, int) and not isinstance(value, bool):
        ok = True
    if not ok:
        want = " or ".join(k.__name__ for k in kinds)
        raise ConfigError(
            f"{name} must be {want}, got {type(value).__name__} {bounded_repr(value)}"
        )


def _runtime_kinds(hint: Any) -> tuple[type, ...]:
    """The JSON types a field annotated ``hint`` takes (``None`` aside): ``int``, ``str | None``,
    ``list[str]`` -> ``(int,)``, ``(str,)``, ``(list,)``; the items of a list are checked in
    ``__post_init__``."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return tuple(kind for arg in args for kind in _runtime_kinds(arg))
    origin = typing.get_origin(hint)
    if isinstance(origin, type):
        return (origin,)
    if isinstance(hint, type):
        return (hint,)
    raise TypeError(f"an info field must be annotated with JSON types, got {hint!r}")


_KINDS: dict[type, dict[str, tuple[type, ...]]] = {}


def field_kinds(cls: type) -> dict[str, tuple[type, ...]]:
    """Field name -> the types ``from_dict`` accepts, read from ``cls``'s annotations (once)."""
    kinds = _KINDS.get(cls)
    if kinds is None:
        hints = typing.get_type_hints(cls)
        kinds = _KINDS.setdefault(cls, {f.name: _runtime_kinds(hints[f.name]) for f in fields(cls)})
    return kinds


class StrictInfo:
    """Mixin: strict ``from_dict`` / ``to_dict`` / JSON round-trip for info dataclasses; a
    field's accepted types are its annotation's (``field_kinds``)."""

    _secret_fields: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_dict(cls, data: object) -> Self:
        ctx = cls.__name__
        if not isinstance(data, dict):
            raise ConfigError(f"{ctx} must be a JSON object, got {type(data).__name__}")
        known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
        kinds = field_kinds(cls)
        unknown = [k for k in data if k not in known]
        if unknown:
            # Bounded: a hostile body may carry a million junk keys.
            shown = ", ".join(bounded_repr(k) for k in sorted(unknown, key=str)[:5])
            more = f" (+{len(unknown) - 5} more)" if len(unknown) > 5 else ""
            raise ConfigError(f"{ctx}: unknown keys [{shown}]{more}; allowed: {sorted(known)}")
        for name, f in known.items():
            required = f.default is MISSING and f.default_factory is MISSING
            if required and name not in data:
                raise ConfigError(f"{ctx}: missing required field {name!r}")
            if name in data:
                optional = f.default is None
                check_type(f"{ctx}.{name}", data[name], kinds[name], optional=optional)
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """JSON body; unset optional fields are dropped (a stock vLLM only sees the mode in use)."""
        names = [f.name for f in fields(self)]  # type: ignore[arg-type]
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str | bytes) -> Self:
        return cls.from_dict(load_json(text, cls.__name__))

    def __repr__(self) -> str:
        # Secrets (unique ids, TCP secrets) must never reach logs or reprs.
        parts: list[str] = []
        for f in fields(self):  # type: ignore[arg-type]
            shown = "<redacted>" if f.name in self._secret_fields else repr(getattr(self, f.name))
            parts.append(f"{f.name}={shown}")
        return f"{type(self).__name__}({', '.join(parts)})"


def check_wire_params(
    ctx: str, buffer_size: int, num_buffers: int, world_size: int, rank_offset: int
) -> None:
    check_buffer_size(f"{ctx}.packed_buffer_size_bytes", buffer_size)
    check_num_buffers(f"{ctx}.packed_num_buffers", num_buffers)
    if not 2 <= world_size <= LIMITS.max_world_size:
        raise ConfigError(
            f"{ctx}.world_size must be in [2, {LIMITS.max_world_size}], got {world_size}"
        )
    if not 1 <= rank_offset < world_size:
        raise ConfigError(
            f"{ctx}.rank_offset must be in [1, world_size), "
            f"got {rank_offset} with world_size {world_size}"
        )


def decode_secret(ctx: str, value: str, nbytes: int) -> bytes:
    """Strict standard (RFC 4648, not URL-safe) base64 of exactly ``nbytes`` bytes."""
    if not isinstance(value, str):
        raise ConfigError(f"{ctx} must be a base64 string, got {type(value).__name__}")
    encoded_len = 4 * ((nbytes + 2) // 3)
    if len(value) != encoded_len:
        # Checked before decoding so a megabyte "id" is refused without work.
        raise ConfigError(
            f"{ctx} must be {encoded_len} base64 characters ({nbytes} bytes), "
            f"got {len(value)} characters"
        )
    try:
        raw = base64.b64decode(value.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise ConfigError(
            f"{ctx} is not strict standard base64 (URL-safe '-'/'_' is refused)"
        ) from None
    if len(raw) != nbytes:
        raise ConfigError(f"{ctx} must decode to exactly {nbytes} bytes, got {len(raw)}")
    return raw


def encode_secret(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def check_listener(ctx: str, info: Any) -> None:
    """The fields every trainer-listens, workers-dial init info shares (TCP, IPC): endpoint,
    secret, wire params and timeout."""
    check_host(f"{ctx}.host", info.host)
    if not 1 <= info.port <= 65535:
        raise ConfigError(f"{ctx}.port must be in [1, 65535], got {info.port}")
    _ = info.secret
    check_wire_params(
        ctx,
        info.packed_buffer_size_bytes,
        info.packed_num_buffers,
        info.world_size,
        info.rank_offset,
    )
    check_seconds(f"{ctx}.timeout_s", info.timeout_s, most=MAX_TIMEOUT_S)
    check_stage_budget(f"{ctx}.stage_budget_bytes", info.stage_budget_bytes)


def check_host(ctx: str, host: str) -> None:
    # A host name is at most 253 characters; whitespace or control characters mean a
    # mangled config, better refused here than as an opaque resolver error later.
    if not host or len(host) > 255 or any(c.isspace() or not c.isprintable() for c in host):
        raise ConfigError(f"{ctx} must be a host name or address, got {bounded_repr(host)}")
