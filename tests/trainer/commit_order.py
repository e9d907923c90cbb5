"""Route lists of rounds whose calls go out at once.

Two groups of a round's calls are sent concurrently: a round paused as a whole opens with the
pause beside the start (both in effect before the first byte), and commits with the finish
beside both cache resets. Each reaches the server in whatever order the threads get there;
``canonical`` puts every run of them in the in-line order, so a test can compare a whole
route list, and what it checks is what is guaranteed: the opening pair before the update,
the commit calls after it and before the resume.
"""

from __future__ import annotations

OPEN = ("pause", "start_weight_update", "start_draft_weight_update")
COMMIT = ("finish_weight_update", "reset_prefix_cache", "reset_encoder_cache")


def canonical(routes: list[str]) -> list[str]:
    """``routes`` with each run of opening calls in ``OPEN`` order and each run of commit
    calls in ``COMMIT`` order."""
    out: list[str] = []
    run: list[str] = []
    group: tuple[str, ...] = ()
    for route in [*routes, ""]:
        kind = OPEN if route in OPEN else COMMIT if route in COMMIT else ()
        if kind and kind is group:
            run.append(route)
            continue
        out += sorted(run, key=group.index) if group else run
        run, group = ([route], kind) if kind else ([], ())
        if route and not kind:
            out.append(route)
    return out
