"""Sliced rounds from sharded ``jax.Array`` s (``jax_side.holdings`` + ``trainer.slice_plan``)
on an FSDP 4 x TP 2 mesh of forced host devices: the wants of real (stub vLLM) workers at
TP 4 with GQA, one expert-parallel worker and one whose map was refused; the plan built
from the arrays' shardings; every transfer read from one addressable shard. Each worker
receives every element it wants exactly once, the values are the tensors', loading them
gives the parameters ``load_weights`` of the full tensors gives, and no trainer process
copies to the host anything but its transfers' slices (no gather, no ``device_get``).
XLA_FLAGS must precede the jax import: subprocesses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.jax_side._slice_values import slice_values
from tests.ranks import free_port, run_ranks
from weightwire.shared.slices import Box, Wants

torch = pytest.importorskip("torch")

from tests.torch_side._sliced_models import SlicedTP, sliced_shapes  # noqa: E402
from weightwire.shared.meta import ParamMeta  # noqa: E402
from weightwire.torch_side.worker.wants import derive_wants  # noqa: E402

RANK_SCRIPT = Path(__file__).with_name("_sliced_rank.py")
SHAPES = sliced_shapes(8, 2)
WORKERS: list[dict[str, Any]] = [
    *({"rank": r, "world": 4} for r in range(4)),
    {"rank": 1, "world": 2, "expert_parallel": True},
]


def session_wants() -> list[Wants]:
    metas = [ParamMeta(n, "float32", s) for n, s in SHAPES.items()]
    wants = [derive_wants(SlicedTP(**kw), metas) for kw in WORKERS]
    return [*wants, Wants.whole(SHAPES, "refused: loads through load_weights")]


def run_processes(mode: str, tmp_path: Path, wants: list[Wants]) -> list[dict[str, Any]]:
    session = tmp_path / "session.json"
    session.write_text(json.dumps({"shapes": SHAPES, "wants": [w.to_json() for w in wants]}))
    n = 1 if mode == "devices" else 2
    port = str(free_port())
    done = run_ranks(
        [[str(RANK_SCRIPT), mode, str(p), port, str(session), str(tmp_path)] for p in range(n)],
        timeout=180,
        merge_stderr=True,
    )
    for proc in done:
        assert proc.returncode == 0, proc.stdout[-4000:]
    return [json.loads((tmp_path / f"report_{p}.json").read_text()) for p in range(n)]


def check_round(tmp_path: Path, wants: list[Wants], reports: list[dict[str, Any]]) -> None:
    index = {n: i for i, n in enumerate(SHAPES)}
    full = {n: slice_values(i, s, Box.whole(s)) for n, s in SHAPES.items() for i in [index[n]]}
    got = {(w, n): np.zeros(s, np.float32) for w in range(len(wants)) for n, s in SHAPES.items()}
    count = {(w, n): np.zeros(s, np.int64) for w in range(len(wants)) for n, s in SHAPES.items()}
    for report in reports:
        shapes_sent = sorted(tuple(hi - lo for lo, hi in box) for _, _, _, box, _ in report["sent"])
        # the only host copies are the transfers' slices: nothing gathered
        assert sorted(tuple(s) for s in report["host_copies"]) == shapes_sent
        assert report["left_on_devices"] == []
        sharded = [n for n in SHAPES if n not in report["whole_on_a_device"]]
        assert "model.layers.0.self_attn.q_proj.weight" in sharded and len(sharded) >= 20
        for worker, _, name, ranges, file in report["sent"]:
            box = Box(tuple((lo, hi) for lo, hi in ranges))
            got[(worker, name)][box.slices()] = np.load(tmp_path / file)
            count[(worker, name)][box.slices()] += 1
    for w, want in enumerate(wants):
        for name, shape in SHAPES.items():
            wanted = np.zeros(shape, np.int64)
            for box in want.regions[name]:
                wanted[box.slices()] = 1
            assert np.array_equal(count[(w, name)], wanted), (w, name)  # each element once
            assert np.array_equal(got[(w, name)] * wanted, full[name] * wanted), (w, name)
    for w, kw in enumerate(WORKERS):
        received = {
            n: torch.from_numpy(np.where(count[(w, n)] > 0, got[(w, n)], -full[n] - 3))
            for n in SHAPES
        }
        torch.manual_seed(w)
        a = SlicedTP(**kw)
        torch.manual_seed(w)
        b = SlicedTP(**kw)
        a.load_weights(received.items())
        b.load_weights((n, torch.from_numpy(t)) for n, t in full.items())
        pb = dict(b.named_parameters())
        for name, p in a.named_parameters():
            assert torch.equal(p, pb[name]), (w, name)


def test_fsdp4_tp2_devices_send_every_wanted_element_once_without_a_gather(
    tmp_path: Path,
) -> None:
    wants = session_wants()
    (report,) = run_processes("devices", tmp_path, wants)
    check_round(tmp_path, wants, [report])
    # each device a rank: all 8 send, replicas share the replicated tensors' bytes
    rank_bytes = {int(r): n for r, n in report["rank_bytes"].items()}
    assert sorted(rank_bytes) == list(range(8))
    assert max(rank_bytes.values()) < 2 * min(rank_bytes.values())
    tp = [int(n) for w, n in report["worker_bytes"].items() if int(w) < 4]
    whole = report["worker_bytes"][str(len(wants) - 1)]
    assert whole == 4 * sum(int(np.prod(s)) for s in SHAPES.values())
    assert max(tp) < whole // 2  # a TP-4 worker receives its slices, not the model


@pytest.mark.slow
def test_two_jax_processes_each_send_from_their_own_shards(tmp_path: Path) -> None:
    wants = session_wants()
    reports = run_processes("processes", tmp_path, wants)
    assert [r["process"] for r in reports] == [0, 1]
    assert reports[0]["transfers"] == reports[1]["transfers"]  # one plan, built by each
    for r in reports:
        assert {rank for _, rank, *_ in r["sent"]} == {r["process"]}
    check_round(tmp_path, wants, reports)
