"""Fuzz every route of the reference server: random JSON, wrong types, huge shapes,
deep nesting, long strings, non-UTF-8 bytes, odd query strings and auth headers.

The contract under test: whatever arrives, the answer is a 2xx or a 4xx with the
JSON error shape, never a 5xx, never an exception escaping the app, never a hang
(each request is bounded). Derandomized, so CI runs the same >= 10,000 payloads
every time; the last test asserts the count.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.fuzz.inproc import API_KEY, FuzzServer
from tests.fuzz.strategies import (
    ALL_ROUTES,
    POST_BODY_ROUTES,
    VALID_TCP_INIT,
    broken_dict,
    completion_bodies,
    dumps,
    json_values,
    raw_bodies,
    update_infos,
)
from weightwire.backends.tcp.info import TCPInitInfo
from weightwire.shared.routes import ROUTES, Route

SCALE = float(os.environ.get("WEIGHTWIRE_FUZZ_SCALE", "1"))
"""Local quick runs only (e.g. 0.05); the count check skips unless the scale is 1."""


def fuzz(n: int) -> Any:
    return settings(
        max_examples=max(1, int(n * SCALE)),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


FUZZ_TESTS = 8
"""How many payload-generating tests this module has (the count check needs them all)."""
ran: set[str] = set()


def would_dial(payload: Any) -> bool:
    """True when an init body is valid: a worker would then dial its (dead) sender and the
    504 that follows is the designed answer, not a server error; such bodies are covered
    by tests/server (dead sender) and tests/faults instead."""
    if (
        not isinstance(payload, dict)
        or not isinstance(payload.get("init_info"), dict)
        or len(payload) != 1
    ):
        return False
    try:
        info = TCPInitInfo.from_dict(payload["init_info"])
    except ValueError:
        return False
    return info.rank_offset + 1 <= info.world_size


def hit(
    srv: FuzzServer,
    route: Route,
    *,
    body: bytes | None = None,
    params: Any = None,
    headers: dict[str, Any] | None = None,
    app: str = "open",
) -> Any:
    """Send one fuzz payload to ``route``; undo a successful pause or sleep so later cases are
    not 503'd (while asleep, ``/resume`` itself is a designed 503 naming ``/wake_up``)."""
    hdrs = {"content-type": "application/json", **(headers or {})} if body is not None else headers
    before = len(srv.errors)
    resp = srv.send(
        route.name, route.method, route.path, content=body, params=params, headers=hdrs, app=app
    )
    # Raised here (not only at the end) so that hypothesis shrinks to the smallest failing payload.
    assert len(srv.errors) == before, srv.errors[-1]
    if resp is not None and route.name in ("pause", "sleep") and resp.status_code == 200:
        undo = ROUTES["resume" if route.name == "pause" else "wake_up"]
        srv.request(
            "POST",
            undo.path,
            app=app,
            headers={"Authorization": f"Bearer {API_KEY}"} if app == "keyed" else None,
        )
    return resp


@pytest.fixture(autouse=True)
def _record(request: pytest.FixtureRequest) -> Any:
    yield
    ran.add(request.node.name)


# ---------------------------------------------------------------------------- any route
@pytest.mark.slow  # 35 s on 2 cores: the README lane stays under 10 minutes
@fuzz(3300)
@given(route=st.sampled_from(ALL_ROUTES), value=json_values, wrap=st.integers(0, 2))
def test_random_json_on_any_route(
    fuzz_server: FuzzServer, route: Route, value: Any, wrap: int
) -> None:
    """Random JSON as the whole body, or under the route's own key (init_info, action...)."""
    key = route.body_key or "x"
    payload = value if wrap == 0 else {key: value} if wrap == 1 else {key: value, "extra": value}
    assume(not (route.name == "init_weight_transfer_engine" and would_dial(payload)))
    body = None if route.method == "GET" else dumps(payload)
    hit(fuzz_server, route, body=body)


@fuzz(1600)
@given(route=st.sampled_from(POST_BODY_ROUTES), raw=raw_bodies)
def test_raw_bytes_on_any_route(fuzz_server: FuzzServer, route: Route, raw: bytes) -> None:
    """Non-UTF-8, truncated, NaN tokens, duplicate keys, megabyte keys, nesting past the parser's
    limit."""
    hit(fuzz_server, route, body=raw)


# ---------------------------------------------------------------------------- near-valid bodies
@pytest.mark.slow  # 17 s on 2 cores
@fuzz(1300)
@given(info=broken_dict(VALID_TCP_INIT))
def test_broken_init_infos(fuzz_server: FuzzServer, info: dict[str, Any]) -> None:
    payload = {"init_info": info}
    assume(not would_dial(payload))
    resp = hit(fuzz_server, ROUTES["init_weight_transfer_engine"], body=dumps(payload))
    assert resp is None or resp.status_code in (400, 413, 422), resp.text


@fuzz(900)
@given(info=update_infos())
def test_update_infos_outside_a_round(fuzz_server: FuzzServer, info: Any) -> None:
    """Huge shapes, mismatched lists, bad dtypes: refused before any worker is asked to allocate."""
    resp = hit(fuzz_server, ROUTES["update_weights"], body=dumps({"update_info": info}))
    assert resp is None or resp.status_code in (400, 409, 413, 422), resp.text


@fuzz(1100)
@given(
    route=st.sampled_from(
        [ROUTES[n] for n in ("weight_checker", "finish_weight_update", "update_weight_version")]
    ),
    body=st.one_of(
        st.fixed_dictionaries(
            {
                "action": st.sampled_from(["checksum", "compare", "reset", "CHECKSUM", ""])
                | json_values
            },
            optional={"baseline": json_values | st.dictionaries(st.text(max_size=30), json_values)},
        ),
        st.fixed_dictionaries({"weight_version": json_values}),
        st.fixed_dictionaries(
            {"new_version": json_values | st.sampled_from(["v", "x" * 1024, "x" * 1025])}
        ),
    ),
)
def test_checker_and_version_bodies(
    fuzz_server: FuzzServer, route: Route, body: dict[str, Any]
) -> None:
    hit(fuzz_server, route, body=dumps(body))


@fuzz(1300)
@given(body=completion_bodies())
def test_completion_bodies(fuzz_server: FuzzServer, body: dict[str, Any]) -> None:
    resp = hit(fuzz_server, ROUTES["completions"], body=dumps(body))
    if resp is not None and resp.status_code == 200:
        assert resp.json()["choices"], resp.text


# ---------------------------------------------------------------------------- query strings, auth
_qtext = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)


@fuzz(700)
@given(
    route=st.sampled_from(
        [ROUTES[n] for n in ("pause", "get_world_size", "is_paused", "resume", "weight_info")]
    ),
    params=st.dictionaries(
        st.sampled_from(["mode", "clear_cache", "include_dp", "x"]) | _qtext,
        st.sampled_from(["keep", "wait", "abort", "true", "FALSE", "1", ""]) | _qtext,
        max_size=3,
    ),
)
def test_query_strings(fuzz_server: FuzzServer, route: Route, params: dict[str, str]) -> None:
    hit(fuzz_server, route, params=params, body=None)


_header_value = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF), max_size=80)


@fuzz(600)
@given(
    route=st.sampled_from(ALL_ROUTES),
    auth=st.one_of(
        _header_value,
        st.sampled_from(
            [
                f"Bearer {API_KEY}",
                f"bearer {API_KEY}",
                "Bearer",
                f"Bearer {API_KEY[:-1]}",
                f"Basic {API_KEY}",
                "",
                f"Bearer {API_KEY} ",
                f"Bearer  {API_KEY}x",
            ]
        ),
    ),
    body=st.sampled_from([None, b"{}", b'{"action": "checksum"}']),
)
def test_authorization_headers(
    fuzz_server: FuzzServer, route: Route, auth: str, body: bytes | None
) -> None:
    """A guarded route answers 401 unless the header carries exactly the key; open routes never
    401."""
    body = None if route.method == "GET" else body
    resp = hit(
        fuzz_server,
        route,
        body=body,
        headers={"Authorization": auth.encode("latin-1")},
        app="keyed",
    )
    if resp is None:
        return
    token = auth.strip().partition(" ")[2].strip()
    authorized = auth.strip().partition(" ")[0].lower() == "bearer" and token == API_KEY
    if route.name in ("health", "version"):
        assert resp.status_code == 200, resp.text
    elif not authorized:
        assert resp.status_code == 401, (auth, resp.status_code, resp.text)
        assert resp.headers.get("www-authenticate") == "Bearer"
    else:
        assert resp.status_code != 401, resp.text


# ---------------------------------------------------------------------------- the count
def test_at_least_ten_thousand_payloads_and_no_server_error(fuzz_server: FuzzServer) -> None:
    if len(ran) < FUZZ_TESTS or SCALE != 1:
        pytest.skip(f"{len(ran)} of the {FUZZ_TESTS} fuzz tests ran, at scale {SCALE}")
    total = sum(fuzz_server.counts.values())
    print(f"fuzz payloads per route: {dict(fuzz_server.counts)}; total {total}")
    assert not fuzz_server.errors, fuzz_server.errors[:10]
    assert total >= 10_000, dict(fuzz_server.counts)
    # every route of the table was exercised, and none only a handful of times
    assert set(fuzz_server.counts) >= set(ROUTES), set(ROUTES) - set(fuzz_server.counts)
    assert min(fuzz_server.counts[r] for r in ROUTES) >= 100, dict(fuzz_server.counts)
