"""External- and hybrid-LB data parallelism: the client's rank offsets put every worker of
every server on its own rank under vLLM's ``rank_offset + dp_index * (TP*PP*PCP) + rank``."""

from __future__ import annotations

import pytest

from tests.control.dp_cluster import LAYOUTS, Cluster, FakeAPIServer, check_layout, documented_rank


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_worker_gets_a_distinct_rank(layout: str) -> None:
    world, ranks = check_layout(layout, documented_rank)
    assert sorted(ranks) == list(range(1, world)), ranks  # 0 is the trainer; no gap, no collision


def test_external_lb_servers_share_one_offset_and_count_once() -> None:
    cluster = Cluster(LAYOUTS["external-lb"])
    client = cluster.client()
    assert (
        client.get_world_size() == 8
    )  # not 4 x 8: each server reports the deployment's global size
    client.init_weight_transfer_engine(
        {"nccl_unique_id_b64": "x", "rank_offset": 1, "world_size": 9}
    )
    assert {h: i["rank_offset"] for h, i in cluster.inits.items()} == {
        f"dp{i}": 1 for i in range(4)
    }
    assert client.rank_layout.deployments == [[0, 1, 2, 3]]


def test_two_deployments_and_an_independent_server_are_stacked() -> None:
    cluster = Cluster(LAYOUTS["two-deployments"])
    client = cluster.client()
    assert client.get_world_size() == 2 + 3 + 4
    assert client.rank_layout.offsets == [1, 1, 3, 6, 6]


def test_a_deployment_missing_a_dp_rank_is_refused() -> None:
    servers = [
        FakeAPIServer(f"dp{i}", per_dp=2, dp_size=4, mode="external", dp_rank=i) for i in (0, 1, 3)
    ]
    with pytest.raises(
        ValueError,
        match=r"data_parallel_size 4, but no listed server drives DP rank\(s\) \[2\]: "
        r"their workers would never join",
    ):
        Cluster(servers).client().get_world_size()


def test_a_dp_rank_listed_twice_is_refused() -> None:
    servers = [
        FakeAPIServer(f"dp{i}", per_dp=1, dp_size=2, mode="external", dp_rank=0) for i in range(2)
    ]
    with pytest.raises(
        ValueError, match=r"DP rank 0 is driven by both http://dp0:8000 and http://dp1:8000"
    ):
        Cluster(servers).client().get_world_size()


def test_unknown_dp_layout_with_several_servers_is_refused() -> None:
    servers = [
        FakeAPIServer(f"dp{i}", per_dp=1, dp_size=2, mode="external", dp_rank=i, server_info=False)
        for i in range(2)
    ]
    with pytest.raises(
        ValueError,
        match=r"runs data parallelism \(2 ranks, 1 per DP rank\) but does not answer "
        r"/server_info",
    ):
        Cluster(servers).client().get_world_size()


def test_single_internal_lb_server_needs_no_server_info() -> None:
    cluster = Cluster([FakeAPIServer("one", per_dp=2, dp_size=2, server_info=False)])
    assert cluster.client().get_world_size() == 4
