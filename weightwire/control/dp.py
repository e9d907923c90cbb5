"""Rank layout of several vLLM servers in one trainer-to-worker group.

A vLLM worker joins at ``rank_offset + dp_index * (TP*PP*PCP) + rank`` (its
``_worker_group_rank``), with ``dp_index`` *global* across the DP deployment. So the
layout depends on how the servers given to the client relate:

- independent servers (no DP, or internal-LB DP: one API server drives all DP ranks):
  each is its own deployment; offsets are shifted by the world sizes before it;
- external-LB DP (one API server per DP rank, ``--data-parallel-rank k``) and hybrid
  LB (one per node, ``--data-parallel-start-rank``): every server of the deployment
  reports the deployment's global TP*PP*PCP*DP from ``/get_world_size?include_dp=true``
  and ranks its workers with the global ``dp_index``; all of them must get the *same*
  ``rank_offset``, and the deployment counts once. Summing and shifting (what a naive
  multi-URL client does) gives wrong ranks and a hang in ``ncclCommInitRank``.

Deployments are told apart with ``/server_info`` (dev mode): ``parallel_config``'s
``data_parallel_size``/``_rank``/``_size_local``/``_external_lb``/``_hybrid_lb`` and the
DP master address, which all servers of one deployment share. A deployment whose
servers do not cover each of its DP ranks exactly once is refused (its missing
ranks' workers would never join).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from weightwire.shared.errors import ConfigError


@dataclass(frozen=True)
class ServerTopology:
    """One server's answers: ``world_size`` with DP, ``per_dp`` without, and its DP config."""

    url: str
    world_size: int
    per_dp: int
    parallel: dict[str, Any] | None = None
    """``/server_info``'s ``vllm_config.parallel_config`` (``None``: not asked / not available)."""

    @property
    def dp_size(self) -> int:
        return self.world_size // self.per_dp

    def owned_dp_ranks(self) -> range:
        """The DP indices whose workers this server's API drives."""
        p = self.parallel or {}
        if p.get("data_parallel_external_lb"):
            start = p.get("data_parallel_rank")
            return range(start, start + 1) if isinstance(start, int) else range(0)
        if p.get("data_parallel_hybrid_lb"):
            start, local = p.get("data_parallel_rank"), p.get("data_parallel_size_local")
            if isinstance(start, int) and isinstance(local, int):
                return range(start, start + local)
            return range(0)
        return range(self.dp_size)  # internal LB: this API server drives every DP rank

    @property
    def deployment_key(self) -> tuple[Any, ...]:
        p = self.parallel or {}
        return (
            p.get("data_parallel_master_ip"),
            p.get("data_parallel_master_port"),
            self.world_size,
            self.per_dp,
        )

    @property
    def split_dp(self) -> bool:
        """DP ranks of this server's deployment are driven by more than one API server."""
        p = self.parallel or {}
        return self.dp_size > 1 and bool(
            p.get("data_parallel_external_lb") or p.get("data_parallel_hybrid_lb")
        )


@dataclass(frozen=True)
class RankLayout:
    offsets: list[int]
    """``rank_offset`` for each server, in the client's order."""
    total: int
    """Inference ranks in the group (the trainer's world size is ``first_rank + total``)."""
    deployments: list[list[int]]
    """Server indices per deployment (external-LB servers of one DP group share one)."""


def plan_ranks(servers: Sequence[ServerTopology], *, first_rank: int = 1) -> RankLayout:
    """The rank layout (``ValueError`` naming the servers and DP ranks at fault)."""
    for s in servers:
        if s.per_dp < 1 or s.world_size % s.per_dp:
            raise ConfigError(
                f"{s.url}: world size with DP {s.world_size} is not a multiple of the per-DP-rank "
                f"world size {s.per_dp}"
            )
    groups: dict[tuple[Any, ...], list[int]] = {}
    order: list[list[int]] = []
    for i, s in enumerate(servers):
        if not s.split_dp:
            order.append([i])
            continue
        if s.parallel is None or s.parallel.get("data_parallel_master_ip") is None:
            raise ConfigError(
                f"{s.url} is one of several API servers of a DP deployment, but its DP master "
                "address is unknown; cannot tell which servers share a deployment"
            )
        key = s.deployment_key
        if key not in groups:
            groups[key] = []
            order.append(groups[key])
        groups[key].append(i)
    offsets = [0] * len(servers)
    offset = first_rank
    for members in order:
        first = servers[members[0]]
        if first.split_dp:
            _check_cover([servers[i] for i in members])
        for i in members:
            offsets[i] = offset
        offset += first.world_size
    return RankLayout(offsets, offset - first_rank, order)


def _check_cover(members: Sequence[ServerTopology]) -> None:
    size = members[0].dp_size
    seen: dict[int, str] = {}
    for s in members:
        owned = s.owned_dp_ranks()
        if not owned:
            raise ConfigError(
                f"{s.url} reports an external/hybrid-LB DP deployment without its "
                "data_parallel_rank"
            )
        for r in owned:
            if not 0 <= r < size:
                raise ConfigError(
                    f"{s.url} drives DP rank {r}, outside its deployment's "
                    f"data_parallel_size {size}"
                )
            if r in seen:
                raise ConfigError(
                    f"DP rank {r} is driven by both {seen[r]} and {s.url}; list each server once"
                )
            seen[r] = s.url
    missing = sorted(set(range(size)) - set(seen))
    if missing:
        urls = ", ".join(s.url for s in members)
        raise ConfigError(
            f"the DP deployment of {urls} has data_parallel_size {size}, but no "
            f"listed server drives DP rank(s) {missing}: their workers would never "
            "join the group; list every DP rank's API server"
        )
