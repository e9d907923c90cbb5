"""Agreeing a secret over a channel others can read: ephemeral Diffie-Hellman.

Several broadcasting trainer ranks coordinate over the trainer group's key-value store
(a c10d or JAX store), which any client of that store can read. Each broadcaster's TCP
star needs a secret that rank 0 also knows (rank 0 hands it to the workers inside the
init POST), so the two agree it here: each side posts only a public value, and the
secret is derived on both ends and never written anywhere.

The group is RFC 3526's 2048-bit MODP group (generator 2); a fresh exponent per
session; the shared value is run through HKDF-SHA256 bound to both public values.
This defends against anyone who can read the store; someone who can also write to it
could stand in the middle, as they could already rewrite every address posted there.

Written here rather than taken from ``cryptography`` (X25519 + HKDF), the library one
would normally use: this module is in ``shared``, which every trainer host imports with
numpy alone, and one modular exponentiation per broadcaster per session does not justify
a compiled dependency there. ``hashlib``/``hmac``/``secrets`` supply every primitive.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from dataclasses import dataclass, field

from weightwire.shared.errors import ConfigError

P = int(
    "FFFFFFFFFFFFFFFFC90FDAA22168C234C4C6628B80DC1CD129024E088A67CC74020BBEA63B139B22514A08798E3404DD"
    "EF9519B3CD3A431B302B0A6DF25F14374FE1356D6D51C245E485B576625E7EC6F44C42E9A637ED6B0BFF5CB6F406B7ED"
    "EE386BFB5A899FA5AE9F24117C4B1FE649286651ECE45B3DC2007CB8A163BF0598DA48361C55D39A69163FA8FD24CF5F"
    "83655D23DCA3AD961C62F356208552BB9ED529077096966D670C354E4ABC9804F1746C08CA18217C32905E462E36CE3B"
    "E39E772C180E86039B2783A2EC07A28FB5C55DF06F4C52C9DE2BCBF6955817183995497CEA956AE515D2261898FA0510"
    "15728E5A8AACAA68FFFFFFFFFFFFFFFF",
    16,
)
G = 2
_BYTES = 256  # a public value's fixed width
_EXPONENT_BITS = (
    512  # well past the group's ~112-bit strength, and 4x cheaper than a full-width one
)


@dataclass(frozen=True)
class KeyShare:
    """One side's ephemeral key.

    ``public_b64`` may be posted anywhere; the exponent never leaves.
    """

    _exponent: int = field(repr=False)
    public_b64: str

    @classmethod
    def new(cls) -> KeyShare:
        exponent = secrets.randbits(_EXPONENT_BITS) | (1 << (_EXPONENT_BITS - 1))
        return cls(
            exponent, base64.b64encode(pow(G, exponent, P).to_bytes(_BYTES, "big")).decode("ascii")
        )

    def secret_with(self, their_public_b64: object, *, length: int, context: bytes) -> bytes:
        """The ``length``-byte secret both sides derive (bound to ``context`` and both public
        values). Raises ``ConfigError`` for a value that is not a usable public value."""
        theirs = _public(their_public_b64)
        shared = pow(theirs, self._exponent, P).to_bytes(_BYTES, "big")
        publics = sorted((self.public_b64, str(their_public_b64)))
        return _hkdf_sha256(shared, b"|".join([context, *(v.encode() for v in publics)]), length)


def _public(value: object) -> int:
    try:
        raw = base64.b64decode(str(value), validate=True)
    except ValueError:
        raise ConfigError("a key share is not base64") from None
    y = int.from_bytes(raw, "big")
    if len(raw) != _BYTES or not 1 < y < P - 1:  # 0, 1 and P-1 would force a known secret
        raise ConfigError("a key share is not a valid public value of the group")
    return y


def _hkdf_sha256(key: bytes, info: bytes, length: int) -> bytes:
    prk = hmac.new(b"weightwire-keyshare/1", key, hashlib.sha256).digest()
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return out[:length]
