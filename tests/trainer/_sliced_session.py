"""One sliced session for the sliced-round tests: a trainer engine (torch or JAX, over
``weightwire_tcp`` or ``weightwire_nccl``) in front of a ``TPClient``, and the checks every
one of those tests makes.

- ``info`` / ``trainer_engine`` / ``opened``: the one way to open a session on a
  ``TPClient`` (``opened``: for a block, the engine shut down and the workers closed after it);
- ``full_tensors`` / ``changed`` / ``put``: a round's full tensors (or a delta round's:
  a few elements changed), put in the trainer's source; ``committed_round`` /
  ``lands_sliced``: one sent (and checked);
- ``assert_loaded`` / ``assert_kept`` / ``fails_keeping``: every worker equals
  ``load_weights`` of the full tensors, or still holds the last committed round's weights
  (after a round that had to fail);
- ``share_limit`` / ``assert_shares``: what one worker's slice of a round may weigh;
- ``cut_link_at`` / ``prepacked``: a link lost mid-round, a rank with no landing map;
- ``run_script`` / ``two_process_reports``: a sliced trainer script in its own process(es)
  (XLA_FLAGS precede jax's import), its last JSON line; ``rounds_then_failure`` /
  ``round_row`` / ``NoCalls``: the two-process scripts' rounds, rows and the non-leading
  process's client.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.torch_side._sliced_models import SlicedTP
from tests.trainer._sliced_workers import Config, TPClient, expected, make, shapes_of
from weightwire.shared.errors import WeightwireError
from weightwire.shared.timeouts import Timeouts
from weightwire.testing.sources import DictSource
from weightwire.trainer import TrainerInitInfo

TIMEOUTS = Timeouts(http_s=60, connect_s=30, warmup_s=30, transfer_s=30)
TP2: Config = (2, 4, 1, False, True)  # one KV head on two ranks, tied head
TP4: Config = (4, 8, 2, False, False)  # two KV heads on four ranks, own head
EP2: Config = (2, 8, 2, True, True)  # whole experts split over the ranks, tied head

NCCL_TIMEOUTS = Timeouts(http_s=60, connect_s=30, warmup_s=30, transfer_s=10)
BACKENDS: dict[str, dict[str, Any]] = {
    "tcp": {"packed_buffer_size_bytes": 1 << 10},  # several frames per worker
    "nccl": {  # several chunks per worker, several waves
        "packed_buffer_size_bytes": 1 << 10,
        "packed_num_buffers": 2,
        "timeouts": NCCL_TIMEOUTS,
    },
}


def full_tensors(config: Config, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes_of(config).items()}


def changed(before: dict[str, np.ndarray], step: int, rate: float = 0.02) -> dict[str, np.ndarray]:
    """``before`` with about ``rate`` of every tensor's elements changed (one at least)."""
    rng = np.random.default_rng(100 + step)
    out = {}
    for name, a in before.items():
        new = a.copy()
        flat = new.reshape(-1)
        flat[rng.choice(flat.size, max(1, int(flat.size * rate)), replace=False)] += 1.0
        out[name] = new
    return out


def replicated_bytes(config: Config) -> int:
    """The tensors every rank takes whole (router, norm)."""
    shapes = shapes_of(config)
    names = ("model.layers.1.mlp.gate.weight", "model.norm.weight")
    return sum(int(np.prod(shapes[n])) * 4 for n in names)


def share_limit(config: Config, dense: float) -> float:
    """The most one worker's slice of a round of ``dense`` bytes may weigh: its 1/TP of the
    model (a little over, for rows that do not split evenly) plus the replicated tensors."""
    return 1.05 * dense / config[0] + replicated_bytes(config)


def assert_shares(received: Sequence[int], config: Config, dense: float) -> None:
    for got in received:
        assert 0 < got <= share_limit(config, dense)


def info(kind: str = "tcp", **kw: Any) -> TrainerInitInfo:
    """The init info of a ``weightwire_<kind>`` session, ``kw`` over the lane's settings."""
    settings: dict[str, Any] = {
        "backend": f"weightwire_{kind}",
        "pause_mode": None,
        "timeouts": TIMEOUTS,
        **BACKENDS[kind],
    }
    return TrainerInitInfo(**{**settings, **kw})


def trainer_engine(
    framework: str,
    client: Any,
    tensors: dict[str, Any],
    backend: str = "tcp",
    group: Any = None,
    **kw: Any,
) -> Any:
    """A ``framework`` ("torch" or "jax") trainer engine over ``backend`` sending the live
    dict ``tensors`` (a test swaps its contents between rounds) to ``client``'s workers;
    ``group``: the trainer's processes, ``kw``: init-info settings."""
    if framework == "jax":
        from weightwire.jax_side.dtypes import describe
        from weightwire.jax_side.engine import JAXTrainerEngine

        return JAXTrainerEngine.trainer_init(
            info(backend, **kw), client=client, source=DictSource(tensors, describe), group=group
        )
    from weightwire.torch_side.sender.engine import TorchTrainerEngine
    from weightwire.torch_side.sender.source import describe_tensor

    source = DictSource(tensors, describe_tensor)
    return TorchTrainerEngine.trainer_init(
        info(backend, **kw), client=client, source=source, group=group
    )


@contextlib.contextmanager
def opened(
    client: TPClient,
    tensors: dict[str, Any],
    framework: str = "torch",
    backend: str = "tcp",
    **kw: Any,
) -> Iterator[Any]:
    """``trainer_engine`` for the block; the engine shut down and the workers closed after it,
    whatever the block raised."""
    engine = trainer_engine(framework, client, tensors, backend, **kw)
    try:
        yield engine
    finally:
        engine.shutdown()
        client.close()


def torch_engine(client: Any, tensors: dict[str, Any], **kw: Any) -> Any:
    return trainer_engine("torch", client, tensors, **kw)


def as_source(framework: str, full: dict[str, np.ndarray]) -> dict[str, Any]:
    """``full`` as ``framework``'s tensors (copies: a round may not write into ``full``)."""
    if framework == "jax":
        import jax.numpy as jnp

        return {n: jnp.asarray(a) for n, a in full.items()}
    return {n: torch.from_numpy(a.copy()) for n, a in full.items()}


def put(tensors: dict[str, Any], full: dict[str, np.ndarray], framework: str = "torch") -> None:
    """Round ``full``'s tensors in the trainer's source ``tensors`` (in place of the last)."""
    tensors.clear()
    tensors.update(as_source(framework, full))


class Prepack:  # a quant method that is not a plain copy after loading
    pass


def prepacked(config: Config, rank: int) -> SlicedTP:
    """A rank whose modules process their weights after loading (a CPU vLLM's prepack): no
    landing map to write through, its loader's reads still recorded."""
    model = make(config, rank)
    model.qkv_proj.quant_method = Prepack()
    return model


def committed_round(
    engine: Any, client: TPClient, tensors: dict[str, Any], step: int = 1, framework: str = "torch"
) -> tuple[dict[str, np.ndarray], list[dict[str, torch.Tensor]]]:
    """Round ``step`` sent (its full tensors put in ``tensors``): those tensors and every
    worker's weights after it, the ones a failed round after it must leave."""
    full = full_tensors(client.config, step)
    put(tensors, full, framework)
    engine.send_weights()
    return full, params(client)


def lands_sliced(
    engine: Any, client: TPClient, tensors: dict[str, Any], step: int, framework: str = "torch"
) -> dict[str, np.ndarray]:
    """Round ``step`` sent (its full tensors put in ``tensors``): it went sliced and every
    worker equals ``load_weights`` of those tensors, which it returns."""
    full = full_tensors(client.config, step)
    put(tensors, full, framework)
    engine.send_weights()
    assert client.last_update["sliced"] is True
    assert_loaded(client, full)
    return full


def params(client: TPClient) -> list[dict[str, torch.Tensor]]:
    return [client.params(r) for r in range(len(client.engines))]


def assert_loaded(client: TPClient, full: dict[str, np.ndarray], what: str = "") -> None:
    """Every worker's parameters equal ``load_weights`` of the full tensors bit for bit."""
    for rank in range(len(client.engines)):
        want = expected(client.config, full, client.ranks[rank])
        got = client.params(rank)
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), f"{what}rank {rank} {name}"


def assert_kept(client: TPClient, before: list[dict[str, torch.Tensor]]) -> None:
    """Every worker holds exactly ``before`` (the last committed round's weights)."""
    for rank, was in enumerate(before):
        now = client.params(rank)
        for name, tensor in was.items():
            assert torch.equal(now[name], tensor), f"rank {rank} {name} changed"


def fails_keeping(
    engine: Any,
    client: TPClient,
    before: list[dict[str, torch.Tensor]],
    match: str | None = None,
    error: type[BaseException] | tuple[type[BaseException], ...] = WeightwireError,
) -> None:
    """The next round raises ``error`` (matching ``match``) and every worker still holds
    ``before`` exactly."""
    with pytest.raises(error, match=match):
        engine.send_weights()
    assert_kept(client, before)


def cut_link_at(engine: Any, worker: int, read: int) -> None:
    """Worker ``worker``'s link drops at the trainer's ``read``-th piece read (the round is
    then mid-transfer)."""
    real, reads = engine.read_box, [0]

    def cut(tensor: Any, box: Any) -> Any:
        reads[0] += 1
        if reads[0] == read:
            engine.session.link._links[worker].sock.shutdown(2)
        return real(tensor, box)

    engine.read_box = cut


def run_script(name: str, *args: str, timeout: float = 240) -> dict[str, Any]:
    """Run ``tests/trainer/<name> *args`` in a process of its own and return the JSON object
    it printed last; a failed run fails the test with the end of its stderr."""
    from tests.ranks import script_report

    return script_report(Path(__file__).with_name(name), *args, timeout=timeout)


def two_process_reports(name: str, *args: str) -> list[dict[str, Any]]:
    """Run ``tests/trainer/<name> RANK PORT *args`` as trainer processes 0 and 1 (the
    two-process scripts) and return what each printed last."""
    from tests import ranks

    script = Path(__file__).with_name(name)
    return ranks.two_rank_reports(script, str(ranks.free_port()), *args, timeout=240)


def assert_trainer_script_rounds(report: dict[str, Any], config: Config) -> None:
    """``_sliced_jax_trainer``'s report: 3 rounds, no whole sharded array read, about one
    model's bytes sent a round, each worker its share."""
    assert report["whole"] == []
    dense = report["dense"]
    assert len(report["rounds"]) == 3
    for r in report["rounds"]:
        assert sum(r["received"]) == r["sent"] <= 1.3 * dense
        assert_shares(r["received"], config, dense)


def round_row(engine: Any, metrics: Any) -> dict[str, Any]:
    """A two-process script's row of one round: what this process sent and what the plan
    gives each sending rank and each worker."""
    plan = engine.session.slicing.plans._plan
    return {
        "version": metrics.version,
        "sent": metrics.nbytes,
        "rank_bytes": {str(r): n for r, n in plan.rank_bytes.items()},
        "worker_bytes": {str(w): n for w, n in plan.worker_bytes.items()},
    }


def rounds_then_failure(
    engine: Any,
    client: Any,
    lead: bool,
    fill: Callable[[int], dict[str, np.ndarray]],
    fail: Callable[[], None],
    send: Callable[[], Any] | None = None,
    row: Callable[[Any, Any], dict[str, Any]] = round_row,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A two-process script's rounds: 3 sliced rounds (``fill(step)`` puts round ``step``'s
    tensors in the source and returns them; ``send``: the round, ``engine.send_weights`` by
    default), each a ``row``; on the ``lead`` process (its ``client`` the workers') every
    worker checked against ``load_weights`` and its bytes added. Then a 4th round after
    ``fail()``, which must fail: its error, the workers still on round 3's weights."""
    send = send or engine.send_weights
    rounds, failure = [], {}
    full: dict[str, np.ndarray] = {}
    for step in (1, 2, 3):
        full = fill(step)
        metrics = send()
        out = row(engine, metrics)
        if lead:
            assert client.last_update.get("sliced") is True
            assert_loaded(client, full, f"round {step} ")
            out["received"] = list(client.received)
        rounds.append(out)
    fill(4)
    fail()
    try:
        send()
    except Exception as exc:
        failure = {"type": type(exc).__name__, "error": str(exc)[:400]}
    if lead:
        assert_loaded(client, full, "failed round: ")
    return rounds, failure


class NoCalls:
    """A non-leading trainer process's client: only rank 0 makes the control plane's calls."""

    def __init__(self, who: str) -> None:
        self._who = who

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*_: Any, **__: Any) -> Any:
            raise AssertionError(f"trainer {self._who} called the server ({name})")

        return call
