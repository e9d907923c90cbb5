"""Route lists of rounds whose commit calls go out at once (a round paused as a whole).

The finish and both cache resets of such a round reach the server in whatever order the
threads get there; ``canonical`` puts every run of them in the in-line order, so a test
can compare a whole route list, and what it checks is what is guaranteed: all three
come after the update and before the resume.
"""

from __future__ import annotations

COMMIT = ("finish_weight_update", "reset_prefix_cache", "reset_encoder_cache")


def canonical(routes: list[str]) -> list[str]:
    """``routes`` with each run of commit calls in ``COMMIT`` order."""
    out: list[str] = []
    run: list[str] = []
    for route in [*routes, ""]:
        if route in COMMIT:
            run.append(route)
            continue
        out += sorted(run, key=COMMIT.index)
        run = []
        if route:
            out.append(route)
    return out
