"""Server-version gates as data, fail-closed: which wire features a vLLM release has.

One table instead of ``if version >= ...`` scattered through engines. The version
string is parsed in full (PEP 440 via ``packaging``: pre-release, dev, post and local
segments), then mapped onto a *known* release row:

- a final or post release of a known minor (``0.32.0``, ``0.33.1``, ``0.32.0.post1``)
  gets that minor's row; a local segment (``0.32.0+cpu``, ``0.33.0+weightwire.0.1.0``)
  names a build of that release and is gated as the release;
- a pre-release or dev build of a known minor (``0.33.0rc1``, ``0.33.0.dev5``) is
  *before* that release: it gets the previous known row, so a feature that first
  ships in the final release is never assumed of its release candidates;
- anything newer than the newest known release (``0.34.0.dev12+g...``, ``0.35.1``,
  ``1.0``) gets the newest known row, but only for features whose wire form has not
  changed between releases (``carries_forward``); a feature whose meaning has
  changed before (empty update info = reuse, since 0.33) is off, because a newer
  server may have changed it again, and getting it wrong is silent (0 tensors
  loaded) or a hang, not an error;
- older than the oldest known release, or unparsable: refused / nothing granted.

``ServerFeatures.for_version(v, override="0.33")`` replaces the mapping with an explicit
known row: the user's word, reported in ``basis`` (and logged by the engine).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from packaging.version import InvalidVersion, Version

from weightwire.shared.errors import ConfigError
from weightwire.shared.limits import bounded_repr

KNOWN_RELEASES: tuple[tuple[int, int], ...] = ((0, 28), (0, 29), (0, 30), (0, 31), (0, 32), (0, 33))
"""Released vLLM minors whose weight-transfer code was read (and run) for this table."""


@dataclass(frozen=True)
class Feature:
    name: str
    first: tuple[int, int]
    carries_forward: bool
    """Assumed of versions newer than the newest known release (wire form unchanged)."""
    what: str


FEATURES: tuple[Feature, ...] = (
    Feature(
        "packed_in_init",
        (0, 28),
        True,
        "packed / buffer geometry travel in the init info, not per round",
    ),
    Feature(
        "draft_route",
        (0, 28),
        True,
        "POST /start_draft_weight_update targets the speculative draft model",
    ),
    Feature(
        "abort_route",
        (0, 28),
        True,
        "POST /abort_requests aborts in-flight requests without pausing",
    ),
    Feature(
        "unique_id_rendezvous",
        (0, 30),
        True,
        "nccl_unique_id_b64 rendezvous for torch-free trainers",
    ),
    Feature(
        "sparse_nccl",
        (0, 30),
        False,
        "the sparse_nccl backend: per patched tensor an int32 flat-index broadcast, then its "
        "values, applied in place through the model's loader (receive code identical 0.30-0.33)",
    ),
    Feature("shutdown_route", (0, 32), True, "POST /shutdown_weight_transfer_engine exists"),
    Feature(
        "weight_checker_route", (0, 32), True, "POST /weight_checker answers per-shard checksums"
    ),
    Feature(
        "packed_scalars",
        (0, 32),
        True,
        "the packed consumer reshapes with view(shape): scalars ([]) load",
    ),
    Feature(
        "nccl_m2n",
        (0, 33),
        False,
        "the nccl_m2n backend: each trainer rank's shard resharded into the workers' layout "
        "(nccl.m2n), the layouts fixed by the init info, a round's update info its names",
    ),
    Feature(
        "reuse_metadata",
        (0, 33),
        False,
        "empty update-info lists reuse the previous round's metadata",
    ),
)

VERSION_GATES: tuple[tuple[tuple[int, int], str, str], ...] = tuple(
    (f.first, f.name, f.what) for f in FEATURES
)
"""``(first release, feature, what changed)`` rows, for reports (``weightwire doctor``)."""

_FEATURE = {f.name: f for f in FEATURES}
_MAX_VERSION_CHARS = (
    128  # packaging would int() any digit run; a 5000-digit "version" is refused first
)


def parse_version(text: object) -> Version:
    """A PEP 440 version (``v`` prefix and surrounding spaces allowed); ``ValueError`` otherwise."""
    if not isinstance(text, str) or len(text) > _MAX_VERSION_CHARS:
        raise ConfigError(f"cannot parse server version {bounded_repr(text)}")
    try:
        return Version(text)
    except (InvalidVersion, ValueError):
        raise ConfigError(f"cannot parse server version {bounded_repr(text)}") from None


def _fmt(release: tuple[int, int]) -> str:
    return f"{release[0]}.{release[1]}"


def _minor(release: tuple[int, ...]) -> tuple[int, int]:
    """``(major, minor)`` of a PEP 440 release tuple (``1`` is ``1.0``)."""
    padded = release + (0,)
    return padded[0], padded[1]


def resolve_release(version: Version) -> tuple[tuple[int, int] | None, bool, str]:
    """``(known row, is_newer_than_known, why)`` for a parsed version (see the module docstring)."""
    minor = _minor(version.release)
    newest, oldest = KNOWN_RELEASES[-1], KNOWN_RELEASES[0]
    if minor > newest:
        return newest, True, f"newer than the newest known release {_fmt(newest)}"
    if minor < oldest:
        return None, False, f"older than the oldest supported release {_fmt(oldest)}"
    if minor not in KNOWN_RELEASES:  # pragma: no cover - the table is contiguous
        return None, False, f"{_fmt(minor)} is not a known release"
    # X.Y.0rc1 / X.Y.0.dev3 come before X.Y.0 (PEP 440); X.Y.1rc1 comes after X.Y.0.
    if (
        version.is_prerelease
        and version.release[2:3] in ((), (0,))
        and not any(version.release[3:])
    ):
        i = KNOWN_RELEASES.index(minor)
        kind = "pre-release" if version.pre is not None else "dev build"
        if i == 0:
            return None, False, f"a {kind} of {_fmt(minor)}, before the oldest supported release"
        return (
            KNOWN_RELEASES[i - 1],
            False,
            f"a {kind} of {_fmt(minor)}: gated as {_fmt(KNOWN_RELEASES[i - 1])}",
        )
    return minor, False, f"release {_fmt(minor)}"


@dataclass(frozen=True)
class ServerFeatures:
    """What the server at ``version`` is taken to support, and on what basis."""

    version: str
    release: tuple[int, int] | None
    basis: str
    packed_in_init: bool
    draft_route: bool
    abort_route: bool
    unique_id_rendezvous: bool
    sparse_nccl: bool
    shutdown_route: bool
    weight_checker_route: bool
    packed_scalars: bool
    nccl_m2n: bool
    reuse_metadata: bool

    @classmethod
    def for_version(cls, version: str, *, override: str | None = None) -> ServerFeatures:
        """Gate ``version`` (raises ``ValueError`` if unparsable).

        ``override`` forces a known row.
        """
        parsed = parse_version(version)
        if override is not None:
            forced = parse_version(override)
            forced_row = _minor(forced.release)
            if forced_row not in KNOWN_RELEASES:
                known = ", ".join(_fmt(r) for r in KNOWN_RELEASES)
                raise ConfigError(f"version override {override!r} is not a known release ({known})")
            flags = {f.name: forced_row >= f.first for f in FEATURES}
            return cls(
                version,
                forced_row,
                f"user override: gated as {_fmt(forced_row)} (server says {version})",
                **flags,
            )
        row, newer, why = resolve_release(parsed)
        flags = {
            f.name: row is not None and row >= f.first and (f.carries_forward or not newer)
            for f in FEATURES
        }
        return cls(version, row, why, **flags)

    def require(self, feature: str, why: str) -> None:
        """Raise ``ValueError`` unless ``feature`` is present.

        The message names ``feature``, the version, the basis and ``why``.
        """
        if getattr(self, feature):
            return
        f = _FEATURE[feature]
        if self.release is not None and self.release >= f.first and not f.carries_forward:
            reason = (
                f"its wire form changed in {_fmt(f.first)} "
                f"and the server ({self.basis}) may have changed it again; "
                "pass a version override if you know it behaves as the newest known release"
            )
        else:
            reason = f"needs >= {_fmt(f.first)}; server is {self.basis}"
        raise ConfigError(f"server version {self.version} lacks {feature} ({reason}): {why}")

    def enabled(self) -> list[str]:
        return [
            f.name
            for f in fields(self)
            if isinstance(getattr(self, f.name), bool) and getattr(self, f.name)
        ]
