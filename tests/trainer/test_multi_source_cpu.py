"""Several broadcasting trainer ranks on CPU (issue 20), against the reference server
(2 worker replicas) over weightwire_tcp.

- JAX: 2 ``jax.distributed`` processes (gloo CPU collectives), params sharded across
  both processes' devices; ``MultiProcessSource`` gathers each layer group with XLA
  collectives and each process broadcasts its share. 3 rounds; every replica holds the
  unsharded model's bytes after each.
- torch: 2 gloo ranks, ``OwnedSource`` gives layer 0 to rank 0 and the rest to rank 1;
  then one ``verify=True`` round (rank 0 checks both slices' digests).
- faults: an orphan name, ranks that disagree on the metadata, a broadcaster that dies
  mid-turn: each a clear error naming the rank / name, within the timeouts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests import ranks

RANK_SCRIPT = Path(__file__).with_name("_multi_source_rank.py")


def run_ranks(
    mode: str, url: str, tmp_path: Path, timeout: float = 240
) -> tuple[dict[str, Any], list[int]]:
    out = tmp_path / f"{mode}.json"
    port = ranks.free_port()
    done = ranks.run_ranks(
        [[str(RANK_SCRIPT), mode, str(r), str(port), url, str(out)] for r in (0, 1)],
        timeout=timeout,
        merge_stderr=True,
    )
    codes = [p.returncode for p in done]
    logs = [p.stdout for p in done]
    assert out.exists(), f"rank 0 wrote no report (exit codes {codes}):\n" + "\n---\n".join(
        x[-3000:] for x in logs
    )
    return json.loads(out.read_text()), codes


def check_rounds(rounds: list[dict[str, Any]]) -> None:
    assert [r["version"] for r in rounds] == ["1", "2", "3"]
    assert all(r["match"] for r in rounds), rounds
    assert [r["version_on_server"] for r in rounds] == ["1", "2", "3"]
    assert [r["reused"] for r in rounds] == [False, True, True]


def test_jax_processes_sharded_two_broadcasters(server_url: str, tmp_path: Path) -> None:
    report, codes = run_ranks("jax", server_url, tmp_path)
    assert codes == [0, 0]
    assert report["cross_process_leaves"] > 0  # really sharded across the processes
    assert report["broadcasters"] == [0, 1]
    check_rounds(report["rounds"])
    check_rounds(report["single"])
    print(
        "jax per-round s: multi",
        [round(r["seconds"], 3) for r in report["rounds"]],
        "single",
        [round(r["seconds"], 3) for r in report["single"]],
    )


@pytest.fixture(scope="module")
def torch_report(
    server_url: str, tmp_path_factory: pytest.TempPathFactory
) -> tuple[dict[str, Any], list[int]]:
    return run_ranks("torch", server_url, tmp_path_factory.mktemp("torch"))


def test_torch_ranks_with_owners(torch_report: tuple[dict[str, Any], list[int]]) -> None:
    report, _ = torch_report
    check_rounds(report["rounds"])
    check_rounds(report["single"])
    # verify=True over both broadcasters: every tensor of both slices checked on both replicas
    assert report["verify"] == {
        "mode": "digest",
        "checked": report["verify"]["tensors"],
        "tensors": report["verify"]["tensors"],
    }
    assert report["verify"]["tensors"] > 10
    print(
        "torch per-round s: multi",
        [round(r["seconds"], 3) for r in report["rounds"]],
        "single",
        [round(r["seconds"], 3) for r in report["single"]],
    )


def test_faults_name_the_rank(torch_report: tuple[dict[str, Any], list[int]]) -> None:
    report, codes = torch_report
    errors = report["errors"]
    print("fault messages:", json.dumps(errors, indent=1))
    assert codes == [0, 17]  # rank 1 died in the last case
    assert "trainer rank 1" in errors["orphan"] and "'lm_head.weight'" in errors["orphan"], errors
    assert "does not hold it" in errors["orphan"]
    assert "disagree on the metadata: rank(s) [1]" in errors["disagree"], errors
    assert "turn of trainer rank 1 (src 1" in errors["dies"], errors
    assert "from src 1" in errors["dies"], errors  # the worker names the broadcaster it lost
