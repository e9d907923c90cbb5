"""The malformed bodies the reference server's routes refuse, each with the status and the
words of the answer: the field named, nothing sent to a worker.

``test_server_http.py`` posts every one; ``None`` as the payload means no body at all.
"""

from __future__ import annotations

from typing import Any

MALFORMED_BODIES: list[tuple[str, Any, int, list[str]]] = [
    ("/init_weight_transfer_engine", {}, 400, ["missing the required field 'init_info'"]),
    ("/init_weight_transfer_engine", None, 400, ["expected a JSON object with 'init_info'"]),
    ("/init_weight_transfer_engine", [1], 422, ["must be a JSON object"]),
    (
        "/init_weight_transfer_engine",
        {"init_info": 5},
        422,
        ["init_info must be a JSON object"],
    ),
    (
        "/init_weight_transfer_engine",
        {"init_info": {}, "x": 1},
        422,
        ["unknown field(s) ['x']"],
    ),
    ("/init_weight_transfer_engine", {"init_info": {"port": "80"}}, 422, ["init_info"]),
    ("/update_weights", {"info": {}}, 400, ["missing the required field 'update_info'"]),
    (
        "/finish_weight_update",
        {"weight_version": 3},
        422,
        ["weight_version must be a non-empty string"],
    ),
    ("/finish_weight_update", {"version": "v"}, 422, ["unknown field(s) ['version']"]),
    ("/update_weight_version", {}, 400, ["'new_version'"]),
    (
        "/update_weight_version",
        {"new_version": ["v"]},
        422,
        ["new_version must be a non-empty string"],
    ),
    ("/weight_checker", {}, 400, ["'action'"]),
    (
        "/weight_checker",
        {"action": "explode"},
        422,
        ["action must be one of ['checksum', 'reset', 'compare']"],
    ),
    ("/weight_checker", {"action": "compare"}, 400, ["requires a 'baseline' object"]),
    (
        "/weight_checker",
        {"action": "compare", "baseline": {"a": 1}},
        422,
        ["baseline must be an object"],
    ),
    ("/start_weight_update", {"x": 1}, 422, ["this route accepts no body"]),
    ("/v1/completions", {"prompt": 5}, 400, ["prompt must be"]),
    ("/v1/completions", {"prompt": "x", "n": 1000}, 400, ["n must be an integer in [1, 64]"]),
    (
        "/v1/completions",
        {"prompt": [7] * 250, "max_tokens": 10},
        400,
        ["exceeds the model's 256 positions"],
    ),
]
