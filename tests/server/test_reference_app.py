"""``web.ReferenceApp``: a plain POST route (the weight round's) answered ahead of FastAPI's
middleware stack gives what the stack would: the user middlewares in their order (the API
key before any body is read, the body limit), the app's exception handlers (a handler's bug
is a 500 naming its type only), the 405 for another method."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from weightwire.tools.server.auth import ApiKeyMiddleware
from weightwire.tools.server.web import (
    ApiError,
    BodyLimitMiddleware,
    ReferenceApp,
    install_error_handlers,
    plain_post,
)


def _app(calls: list[str]) -> ReferenceApp:
    app = ReferenceApp(docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=100)
    app.add_middleware(ApiKeyMiddleware, api_key="k")

    @plain_post(app, "/round")
    async def round_(request: Request) -> JSONResponse:
        body = await request.body()
        calls.append(body.decode())
        if body == b"refuse":
            raise ApiError(409, "a round is open", param="x")
        if body == b"bug":
            raise RuntimeError("a secret detail")
        return JSONResponse({"got": body.decode(), "q": request.query_params.get("q")})

    @app.post("/other")
    async def other(request: Request) -> dict[str, Any]:
        return {"other": (await request.body()).decode()}

    return app


def test_a_plain_post_route_answers_as_fastapi_s_stack_would() -> None:
    calls: list[str] = []
    app = _app(calls)
    assert set(app.plain) == {"/round"}
    key = {"Authorization": "Bearer k"}
    with TestClient(app, raise_server_exceptions=False) as http:
        ok = http.post("/round?q=1", content=b"abc", headers=key)
        assert ok.status_code == 200 and ok.json() == {"got": "abc", "q": "1"}
        refused = http.post("/round", content=b"refuse", headers=key)
        assert refused.status_code == 409
        assert refused.json()["error"] == {
            "message": "a round is open",
            "type": "conflict_error",
            "param": "x",
            "code": 409,
        }
        bug = http.post("/round", content=b"bug", headers=key)
        assert bug.status_code == 500 and "secret" not in bug.text
        assert bug.json()["error"]["message"].startswith("internal server error (RuntimeError)")
        no_key = http.post("/round", content=b"never read")
        assert no_key.status_code == 401 and no_key.headers["www-authenticate"] == "Bearer"
        big = http.post("/round", content=b"x" * 101, headers=key)
        assert big.status_code == 413 and "exceeds the limit of 100 bytes" in big.text
        assert http.get("/round", headers=key).status_code == 405
        other = http.post("/other", content=b"o", headers=key)
        assert other.json() == {"other": "o"}
        assert http.post("/other", content=b"o").status_code == 401
    assert calls == ["abc", "refuse", "bug"]  # the refused ones never reached the handler
