"""External-/hybrid-/internal-LB DP layouts checked against vLLM's own rank computation.

The lines that compute a worker's rank in the trainer-to-worker group are taken from
the interop venv's ``vllm/distributed/weight_transfer/nccl_common.py`` (0.32: inline in
``worker_init_process_group``; 0.33: ``_worker_group_rank``) with ``ast`` and run
unchanged on each worker of each fake API server, with the ``rank_offset`` our client
posted to that server. Every worker must land on its own rank in ``[1, world_size)``.
"""

from __future__ import annotations

import ast
import glob
import os
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.control.dp_cluster import LAYOUTS, check_layout

pytestmark = pytest.mark.interop


def _nccl_common() -> list[str]:
    paths = []
    venv = os.environ.get("WEIGHTWIRE_INTEROP_VENV")
    if venv:
        paths += sorted(
            glob.glob(
                os.path.join(
                    venv,
                    "lib",
                    "python*",
                    "site-packages",
                    "vllm",
                    "distributed",
                    "weight_transfer",
                    "nccl_common.py",
                )
            )
        )[:1]
    if os.environ.get("WEIGHTWIRE_VLLM_SRC"):
        paths.append(
            os.path.join(
                os.environ["WEIGHTWIRE_VLLM_SRC"],
                "vllm",
                "distributed",
                "weight_transfer",
                "nccl_common.py",
            )
        )
    return paths


def vllm_rank_formula(path: str) -> Callable[[int, int, int, int], int]:
    """vLLM's rank computation from ``path``, as
    ``(rank_offset, dp_index, per_dp, rank) -> group rank``."""
    tree = ast.parse(Path(path).read_text())
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    if "_worker_group_rank" in funcs:
        fn = funcs["_worker_group_rank"]
        fn.returns, fn.args.args[1].annotation = None, None
        code = ast.Module(body=[fn], type_ignores=[])
        call = "_worker_group_rank(init_info.rank_offset, parallel_config)"
    else:
        body = funcs["worker_init_process_group"].body
        stmts = []
        for stmt in body:
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                continue  # the docstring
            stmts.append(stmt)
            if isinstance(stmt, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "rank" for t in stmt.targets
            ):
                break
        else:
            raise AssertionError(f"no `rank = ...` in worker_init_process_group of {path}")
        args = ast.arguments(
            posonlyargs=[],
            args=[ast.arg("init_info"), ast.arg("parallel_config")],
            kwonlyargs=[],
            kw_defaults=[],
            defaults=[],
        )
        stmts.append(ast.Return(ast.Name("rank", ast.Load())))
        code = ast.Module(
            body=[ast.FunctionDef("_rank", args, stmts, [], None, type_params=[])], type_ignores=[]
        )
        call = "_rank(init_info, parallel_config)"
    namespace: dict = {}
    exec(compile(ast.fix_missing_locations(code), path, "exec"), namespace)  # vLLM's own lines

    def formula(rank_offset: int, dp_index: int, per_dp: int, rank: int) -> int:
        env = {
            **namespace,
            "init_info": SimpleNamespace(rank_offset=rank_offset),
            "parallel_config": SimpleNamespace(
                data_parallel_index=dp_index, world_size=per_dp, rank=rank
            ),
        }
        return eval(call, env)

    return formula


@pytest.mark.parametrize("path", _nccl_common() or [None])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_against_vllm_rank_formula(path: str | None, layout: str) -> None:
    if path is None:
        pytest.skip("no vLLM: run tests/interop/run.sh (it exports WEIGHTWIRE_INTEROP_VENV)")
    formula = vllm_rank_formula(path)
    assert (
        formula(1, 2, 3, 1) == 1 + 2 * 3 + 1
    )  # the documented shape, before trusting the layouts to it
    world, ranks = check_layout(layout, formula)
    assert sorted(ranks) == list(range(1, world)), ranks
