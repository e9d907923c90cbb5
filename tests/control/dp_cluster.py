"""Fake vLLM API servers of DP deployments, and the check that every worker of every
server lands on its own rank of the trainer-to-worker group under a given rank formula.

``vllm_rank(rank_offset, dp_index, world_size_per_dp, rank)`` is the formula; the
unit tests pass the documented one, the interop lane passes vLLM's own code."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from weightwire.control import HTTPWeightSyncClient

RankFormula = Callable[[int, int, int, int], int]


def documented_rank(rank_offset: int, dp_index: int, per_dp: int, rank: int) -> int:
    return rank_offset + dp_index * per_dp + rank


@dataclass
class FakeAPIServer:
    """One API server: TP*PP*PCP = ``per_dp`` workers per DP rank, driving ``dp_ranks``."""

    host: str
    per_dp: int
    dp_size: int = 1
    mode: str = "internal"  # internal | external | hybrid
    dp_rank: int = 0
    local: int = 1
    master_port: int = 29500
    server_info: bool = True

    def dp_indices(self) -> range:
        if self.mode == "external":
            return range(self.dp_rank, self.dp_rank + 1)
        if self.mode == "hybrid":
            return range(self.dp_rank, self.dp_rank + self.local)
        return range(self.dp_size)

    def parallel_config(self) -> dict:
        return {
            "data_parallel_size": self.dp_size,
            "data_parallel_rank": self.dp_rank,
            "data_parallel_size_local": self.local if self.mode != "internal" else self.dp_size,
            "data_parallel_external_lb": self.mode == "external",
            "data_parallel_hybrid_lb": self.mode == "hybrid",
            "data_parallel_master_ip": "10.0.0.1",
            "data_parallel_master_port": self.master_port,
            "tensor_parallel_size": self.per_dp,
            "pipeline_parallel_size": 1,
        }


class Cluster:
    def __init__(self, servers: list[FakeAPIServer]) -> None:
        self.servers = {s.host: s for s in servers}
        self.inits: dict[str, dict] = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        s, path = self.servers[request.url.host], request.url.path
        if path == "/get_world_size":
            with_dp = request.url.params.get("include_dp", "true") == "true"
            return httpx.Response(
                200, json={"world_size": s.per_dp * (s.dp_size if with_dp else 1)}
            )
        if path == "/server_info":
            if not s.server_info:
                return httpx.Response(404, json={"detail": "Not Found"})
            assert request.url.params.get("config_format") == "json"
            return httpx.Response(
                200, json={"vllm_config": {"parallel_config": s.parallel_config()}}
            )
        if path == "/init_weight_transfer_engine":
            self.inits[s.host] = json.loads(request.content)["init_info"]
        return httpx.Response(200, json={"message": "ok"})

    def client(self) -> HTTPWeightSyncClient:
        urls = [f"http://{h}:8000" for h in self.servers]
        return HTTPWeightSyncClient(urls, timeout=5, transport=httpx.MockTransport(self))

    def worker_ranks(self, formula: RankFormula) -> list[int]:
        """Every worker's rank, from the init info its server got and the formula."""
        ranks = []
        for host, s in self.servers.items():
            offset = self.inits[host]["rank_offset"]
            for dp in s.dp_indices():
                ranks += [formula(offset, dp, s.per_dp, r) for r in range(s.per_dp)]
        return ranks


LAYOUTS: dict[str, list[FakeAPIServer]] = {
    # One API server per DP rank (external LB), TP=2: each reports the global 8.
    "external-lb": [
        FakeAPIServer(f"dp{i}", per_dp=2, dp_size=4, mode="external", dp_rank=i) for i in range(4)
    ],
    # One API server per node, two DP ranks each (hybrid LB).
    "hybrid-lb": [
        FakeAPIServer(f"node{i}", per_dp=1, dp_size=4, mode="hybrid", dp_rank=2 * i, local=2)
        for i in range(2)
    ],
    # One API server driving DP=2 itself (internal LB), next to an independent TP=1 server.
    "internal-lb+independent": [
        FakeAPIServer("big", per_dp=2, dp_size=2),
        FakeAPIServer("solo", per_dp=1),
    ],
    # Two external-LB deployments (told apart by their DP master) and an independent server.
    "two-deployments": [
        *[
            FakeAPIServer(
                f"a{i}", per_dp=1, dp_size=2, mode="external", dp_rank=i, master_port=1000
            )
            for i in range(2)
        ],
        FakeAPIServer("solo", per_dp=3),
        *[
            FakeAPIServer(
                f"b{i}", per_dp=2, dp_size=2, mode="external", dp_rank=1 - i, master_port=2000
            )
            for i in range(2)
        ],
    ],
}


def check_layout(name: str, formula: RankFormula) -> tuple[int, list[int]]:
    """Init every server of a layout through the client; ``(world_size, worker ranks)``."""
    cluster = Cluster([FakeAPIServer(**vars(s)) for s in LAYOUTS[name]])
    client = cluster.client()
    world = 1 + client.get_world_size()
    client.init_weight_transfer_engine(
        {"nccl_unique_id_b64": "x", "rank_offset": 1, "world_size": world}
    )
    return world, cluster.worker_ranks(formula)
