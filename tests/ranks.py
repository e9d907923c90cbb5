"""Trainer ranks as separate processes on this host: a free port for their rendezvous, and
one launcher that waits for every rank within a timeout and never leaves one running."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    argvs: list[list[str]],
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    merge_stderr: bool = False,
) -> list[subprocess.CompletedProcess[str]]:
    """Start one Python process per argument list at once (they rendezvous with each other),
    then collect each one's output; a rank still running when the others are done or the
    timeout struck is killed, so a failed case leaves no process behind."""
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    procs = [
        subprocess.Popen(
            [sys.executable, *argv],
            cwd=ROOT,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
            text=True,
        )
        for argv in argvs
    ]
    done = []
    try:
        for argv, p in zip(argvs, procs, strict=True):
            out, err = p.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(argv, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return done


def script_report(script: Path, *args: str, timeout: float = 240) -> dict[str, Any]:
    """Run ``script *args`` in a process of its own (this checkout importable) and return the
    JSON object it printed last; a failed run fails the test with the end of its stderr."""
    done = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def two_rank_reports(script: Path, *args: str, timeout: float = 120) -> list[dict[str, Any]]:
    """Run ``script RANK *args`` as ranks 0 and 1 (one OpenMP thread each: the host's cores
    are shared) and return the JSON object each one printed last; a failed rank fails the
    test with the end of its stderr."""
    done = run_ranks(
        [[str(script), str(r), *args] for r in range(2)],
        timeout=timeout,
        env={"OMP_NUM_THREADS": "1"},
    )
    for rank in done:
        assert rank.returncode == 0, rank.stderr[-3000:]
    return [json.loads(rank.stdout.strip().splitlines()[-1]) for rank in done]


def join_gloo_pair() -> int:
    """In a rank script that ``two_rank_reports`` started (``script RANK PORT ...``): join the
    two-rank gloo group at that port, bounded to 60 s, and return this rank."""
    from datetime import timedelta

    import torch.distributed as dist  # only rank scripts call this: the module stays torch-free

    rank, port = int(sys.argv[1]), int(sys.argv[2])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    return rank
