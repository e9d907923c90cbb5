"""Security properties, checked on the real processes of this suite.

- the reference server's weight routes need the bearer key; /health and /version do not;
- a TCP data connection must prove the session's secret: an impostor at the trainer's
  port is refused and the real worker still joins;
- servers (and the trainer's rendezvous) bind loopback unless told otherwise;
- no pickle (or marshal, or multiprocessing queues/pipes) anywhere in ``weightwire``;
- session secrets never reach a log, a repr or an error, and the API key never a log.
  This module runs last in the suite, so it greps the logs of every server the suite
  started, with every secret every test posted.
"""

from __future__ import annotations

import ast
import base64
import logging
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.faults.harness import (
    API_KEY,
    POSTED_INIT_INFOS,
    Probe,
    TensorSource,
    assert_weights,
    client_for,
    engine_for,
)
from tests.faults.servers import LAUNCHED, Server, listening_sockets
from weightwire.shared.errors import TransferError
from weightwire.shared.routes import ROUTES

pytestmark = pytest.mark.timeout(120)
PACKAGE = Path(__file__).resolve().parents[2] / "weightwire"


# ----------------------------------------------------------------------------- bearer auth
@pytest.mark.parametrize("route", list(ROUTES.values()), ids=lambda r: r.name)
def test_weight_routes_need_the_bearer_key(shared_server: Server, route: Any) -> None:
    anonymous = Probe(shared_server.url, headers={})
    try:
        resp = anonymous.http.request(route.method, route.path)
        wrong = anonymous.http.request(
            route.method, route.path, headers={"Authorization": "Bearer nope"}
        )
    finally:
        anonymous.close()
    if route.name in ("health", "version"):
        assert resp.status_code == 200, resp.text
        return
    assert resp.status_code == 401 and "missing API key" in resp.text, resp.text
    assert wrong.status_code == 401 and "invalid API key" in wrong.text, wrong.text
    assert resp.headers["www-authenticate"] == "Bearer"


# ----------------------------------------------------------------------------- data-plane auth
def test_tcp_impostor_is_refused_and_the_real_worker_joins(
    shared_server: Server, probe: Probe, source: TensorSource, caplog: pytest.LogCaptureFixture
) -> None:
    """Before the server sees the init info, an impostor who knows the trainer's host and
    port (not the secret) dials in claiming rank 1; it is refused, the real worker then
    proves the secret as rank 1, and the round lands."""
    from weightwire.backends.tcp.comm import TCPCommunicator

    refused: list[BaseException] = []

    class Impostor:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

        def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
            def dial() -> None:
                try:
                    TCPCommunicator.connect(
                        host=init_info["host"],
                        port=init_info["port"],
                        secret=bytes(128),
                        rank=1,
                        world_size=init_info["world_size"],
                        timeout=5,
                    )
                except TransferError as exc:
                    refused.append(exc)

            t = threading.Thread(target=dial)
            t.start()
            t.join(10)
            self.inner.init_weight_transfer_engine(init_info)

    caplog.set_level(logging.WARNING, logger="weightwire.backends.tcp.rendezvous")
    engine = engine_for(shared_server.url, source, client=Impostor(client_for(shared_server.url)))
    try:
        want = source.perturb(301)
        engine.send_weights("after-impostor")
    finally:
        engine.shutdown()
    assert refused and "wrong secret" in str(refused[0]), refused
    assert "refused" in caplog.text and "wrong secret" in caplog.text
    assert_weights(probe, want, "after-impostor")


def test_every_session_has_a_fresh_128_byte_secret(
    shared_server: Server, source: TensorSource
) -> None:
    for _ in range(2):
        engine_for(shared_server.url, source).shutdown()
    secrets = [
        info["secret_b64"]
        for info in POSTED_INIT_INFOS
        if isinstance(info, dict) and "secret_b64" in info
    ]
    assert len(secrets) >= 2
    assert all(len(base64.b64decode(s, validate=True)) == 128 for s in secrets)
    assert len(set(secrets)) == len(secrets), "a session secret was reused"


# ----------------------------------------------------------------------------- loopback
def test_server_and_rendezvous_bind_loopback_by_default(shared_server: Server) -> None:
    from weightwire.backends.tcp.rendezvous import TCPRendezvous
    from weightwire.tools.server.serve_args import build_parser
    from weightwire.trainer import TrainerInitInfo

    assert build_parser().parse_args(["--model", "m"]).host == "127.0.0.1"
    assert shared_server.url.startswith("http://127.0.0.1:")
    pids = [shared_server.pid, *shared_server.worker_pids().values()]
    bound = set().union(*(listening_sockets(pid) for pid in pids))
    assert bound and all(addr.startswith("127.0.0.1:") for addr in bound), bound

    assert TrainerInitInfo().tcp_bind_host == "127.0.0.1"
    rv = TCPRendezvous(world_size=2)
    try:
        assert f"127.0.0.1:{rv.port}" in listening_sockets()
    finally:
        rv.close()


# ----------------------------------------------------------------------------- no pickle
_BANNED_MODULES = {
    "pickle",
    "_pickle",
    "cPickle",
    "cloudpickle",
    "dill",
    "marshal",
    "shelve",
    "joblib",
    "copyreg",
    "multiprocessing.connection",
    "multiprocessing.managers",
    "multiprocessing.queues",
}
_BANNED_MP = {
    "Queue",
    "SimpleQueue",
    "JoinableQueue",
    "Pipe",
    "Manager",
    "Pool",
    "Listener",
    "Client",
}


def pickle_uses(source: str, filename: str = "<src>") -> list[str]:
    """Every import of a pickling module, multiprocessing queue/pipe, and torch.load /
    np.load call that may unpickle, in one module's source."""
    tree = ast.parse(source, filename)
    found: list[str] = []
    uses_mp = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                uses_mp |= alias.name.startswith("multiprocessing")
                if alias.name in _BANNED_MODULES or alias.name.split(".")[0] in _BANNED_MODULES:
                    found.append(f"{filename}:{node.lineno} import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            uses_mp |= node.module.startswith("multiprocessing")
            if node.module in _BANNED_MODULES or node.module.split(".")[0] in _BANNED_MODULES:
                found.append(f"{filename}:{node.lineno} from {node.module} import ...")
            if node.module.startswith("multiprocessing"):
                found += [
                    f"{filename}:{node.lineno} from {node.module} import {a.name}"
                    for a in node.names
                    if a.name in _BANNED_MP
                ]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            attr = node.func.attr
            kwargs = {k.arg: k.value for k in node.keywords}
            if (
                attr == "load"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
            ):
                safe = (
                    isinstance(kwargs.get("weights_only"), ast.Constant)
                    and kwargs["weights_only"].value is True
                )
                if not safe:
                    found.append(f"{filename}:{node.lineno} torch.load without weights_only=True")
            if (
                attr == "load"
                and isinstance(kwargs.get("allow_pickle"), ast.Constant)
                and kwargs["allow_pickle"].value
            ):
                found.append(f"{filename}:{node.lineno} load(allow_pickle=True)")
            if (
                attr in ("loads", "load")
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id in _BANNED_MODULES
            ):
                found.append(f"{filename}:{node.lineno} {node.func.value.id}.{attr}")
    if uses_mp:
        found += [
            f"{filename}:{n.lineno} multiprocessing {n.attr}"
            for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and n.attr in _BANNED_MP
        ]
    return found


def test_the_pickle_scanner_catches_each_pattern() -> None:
    planted = {
        "import pickle": 1,
        "import cloudpickle as cp": 1,
        "from marshal import loads": 1,
        "import multiprocessing as mp\nq = mp.Queue()": 1,
        "from multiprocessing import Pipe": 1,
        "import torch\ntorch.load(f)": 1,
        "import numpy as np\nnp.load(f, allow_pickle=True)": 1,
        "import multiprocessing\nctx = multiprocessing.get_context('spawn')\nctx.SimpleQueue()": 1,
        "import torch\ntorch.load(f, weights_only=True)": 0,
        "import json\njson.loads(s)": 0,
        "import queue\nqueue.SimpleQueue()": 0,
    }
    for src, n in planted.items():
        assert len(pickle_uses(src)) == n, (src, pickle_uses(src))


# vLLM 0.33's nccl_m2n workers publish their metadata as pickles on a store the trainer must
# serve (vLLM's design): the one module that reads them builds plain data only.
M2N_STORE = "weightwire/backends/nccl/m2n_store.py"


def test_no_pickle_anywhere_in_weightwire() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 20
    found = [
        hit for f in files for hit in pickle_uses(f.read_text(), str(f.relative_to(PACKAGE.parent)))
    ]
    assert [h.split(":")[0] for h in found] == [M2N_STORE], found


def test_the_m2n_store_unpickles_plain_data_only() -> None:
    """Its only unpickling is ``loads_plain`` (no ``pickle.load[s]`` call); a pickle that names
    any callable, even a harmless one, is refused before anything of it is built."""
    import pickle

    from weightwire.backends.nccl.m2n_store import StoreError, loads_plain

    source = (PACKAGE.parent / M2N_STORE).read_text()
    assert "pickle.loads(" not in source and "pickle.load(" not in source
    envelope = {"rank": 1, "names": ["a", "b"], "shape": (2, 3), "ok": True, "err": None}
    assert loads_plain(pickle.dumps(envelope)) == envelope
    with pytest.raises(StoreError, match=r"names builtins\.print; only plain data"):
        loads_plain(pickle.dumps(print))


# ----------------------------------------------------------------------------- secrets in logs
def _variants(secret_b64: str) -> list[str]:
    raw = base64.b64decode(secret_b64)
    return [
        secret_b64,
        secret_b64[:24],
        base64.urlsafe_b64encode(raw).decode()[:24],
        raw.hex()[:32],
        repr(raw)[2:40],
    ]


def test_secrets_never_in_logs_or_reprs(
    shared_server: Server, probe: Probe, source: TensorSource, caplog: pytest.LogCaptureFixture
) -> None:
    """A full round with every logger at DEBUG (trainer side), then every log any server of
    this session wrote (API and workers at DEBUG for the shared one), their stdout and
    the workers' command lines: no session secret, in any common encoding, and no API key."""
    caplog.set_level(logging.DEBUG)
    client = client_for(shared_server.url)
    engine = engine_for(shared_server.url, source, client=client)
    try:
        want = source.perturb(302)
        metrics = engine.send_weights("debug-round")
        reprs = [
            repr(engine),
            repr(engine.session.link),
            repr(client),
            repr(metrics),
            str(metrics.summary()),
        ]
        from weightwire.backends.tcp.info import TCPInitInfo

        reprs.append(repr(TCPInitInfo.from_dict(client.posted[-1])))
    finally:
        engine.shutdown()
    assert_weights(probe, want, "debug-round")
    assert "weightwire" in caplog.text and len(caplog.records) > 5, "DEBUG logging captured nothing"

    texts = {"trainer logs (caplog)": caplog.text, "reprs": "\n".join(reprs)}
    for i, server in enumerate(LAUNCHED):
        texts[f"server {i} log"] = server.log()
        texts[f"server {i} stdout"] = "\n".join(server.stdout)
    # The workers log each join at INFO (nothing logs below it today): proof the logs were verbose.
    assert "joined as rank 1" in shared_server.log(), "the shared server's logs are not verbose"
    texts["API process cmdline"] = (
        Path(f"/proc/{shared_server.pid}/cmdline").read_bytes().decode(errors="replace")
    )
    for pid in shared_server.worker_pids().values():
        texts[f"worker {pid} cmdline"] = (
            Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        )
    secrets = [
        info["secret_b64"]
        for info in POSTED_INIT_INFOS
        if isinstance(info, dict) and "secret_b64" in info
    ]
    assert client.posted[-1]["secret_b64"] in secrets
    leaks = [
        f"{where}: secret #{n} ({variant[:6]}...)"
        for n, secret in enumerate(secrets)
        for variant in _variants(secret)
        for where, text in texts.items()
        if variant in text
    ]
    leaks += [f"{where}: the API key" for where, text in texts.items() if API_KEY in text]
    assert not leaks, leaks
