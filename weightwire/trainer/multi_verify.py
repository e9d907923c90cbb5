"""``verify=True`` with several broadcasters: rank 0 checks the union of every slice's digests.

Each broadcaster digests the bytes of its own slice as it sends them (``transfer.tap``)
and publishes them with its round status over the trainer's ``Exchange``; rank 0 joins
them with its own and runs the ordinary check (``trainer.verify.RoundVerifier``), so the
verdict covers every tensor of the round. A mismatch names each bad tensor's
broadcaster (rank and ``src``); a broadcaster whose digests lack a name of its slice
is an error before the server is asked (a check over fewer tensors would pass silently).
"""

from __future__ import annotations

from weightwire.shared.client import ServerControls
from weightwire.trainer.broadcast_plan import BroadcastPlan
from weightwire.trainer.group import Exchange
from weightwire.trainer.verify import RoundVerifier, VerifyError, VerifyReport


def gather_digests(
    x: Exchange, bplan: BroadcastPlan, own: dict[str, str], timeout: float
) -> dict[str, str]:
    """Every slice's digests (rank 0's own plus each broadcaster's published ones)."""
    sent: dict[str, str] = {}
    for turn in bplan.turns:
        got = own if turn.rank == 0 else (x.get("status", turn.rank, timeout).get("digests") or {})
        missing = [m.name for m in turn.metas if m.name not in got]
        if missing:
            raise VerifyError(
                f"trainer rank {turn.rank} (src {turn.src}) published no digest for {missing[0]!r}"
                f"{f' (+{len(missing) - 1} more)' if len(missing) > 1 else ''}",
                {},
            )
        sent.update({m.name: got[m.name] for m in turn.metas})
    return sent


def verify_union(
    verifier: RoundVerifier,
    client: ServerControls,
    bplan: BroadcastPlan,
    sent: dict[str, str],
    version: str,
    *,
    draft: bool,
) -> VerifyReport:
    """``verifier.after_round`` over every slice; with several broadcasters a failure names
    each tensor's broadcaster."""
    try:
        return verifier.after_round(client, sent, version, draft=draft)
    except VerifyError as exc:
        if not bplan.multi:  # one broadcaster: the mismatch needs no name
            raise
        who = {m.name: (t.rank, t.src) for t in bplan.turns for m in t.metas}
        bad = sorted({n for names in exc.mismatched.values() for n in names if n in who})
        if not bad:
            raise
        shown = ", ".join(f"{n!r}: trainer rank {who[n][0]} (src {who[n][1]})" for n in bad[:8])
        more = f" (+{len(bad) - 8} more)" if len(bad) > 8 else ""
        out = VerifyError(f"{exc}; broadcast by {shown}{more}", exc.mismatched)
        out.committed, out.weight_version = exc.committed, exc.weight_version
        raise out from None
