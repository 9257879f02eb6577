"""Ring α–β costs of the collectives a worker group issues; see [Note: ring costs].

[Note: ring costs]
A ring collective over ``n`` ranks moves ``(n-1)/n · S`` bytes through every rank's link for an
all-gather or a reduce-scatter of ``S`` total bytes, twice that for an all-reduce, and takes
``n-1`` latency hops (each twice for an all-reduce). Inside one node a rank's link is ``intra_bw``.
A ring that spans nodes crosses each node's NICs: if ``g`` of its ranks share a node of ``G``
GPUs, ``G/g`` rings run through that node's ``inter_bw`` at once (tensor parallelism makes
``g < G``), so each gets ``inter_bw · g / G``. Hops: ``g-1`` inside and ``nodes-1`` between nodes
(NCCL's hierarchical rings).
"""
from __future__ import annotations

from dataclasses import dataclass

from zeroray.plan.hardware import Cluster


@dataclass(frozen=True)
class Ring:
    """The ring of one data-parallel group: its bus bandwidth and the latency of one pass."""

    ranks: int
    bw: float
    latency: float

    def all_gather(self, nbytes: float) -> float:
        if self.ranks <= 1:
            return 0.0
        return self.latency + (self.ranks - 1) / self.ranks * nbytes / self.bw

    reduce_scatter = all_gather

    def all_reduce(self, nbytes: float) -> float:
        return 2.0 * self.all_gather(nbytes)


def dp_ring(cluster: Cluster, dp: int, tp: int = 1) -> Ring:
    """The ring of a data-parallel group of ``dp`` ranks, each ``tp`` GPUs apart; see [Note: ring costs]."""
    per_node = max(1, cluster.gpus_per_node // tp)  # members of one group on a node
    if dp <= per_node:
        return Ring(dp, cluster.intra_bw, (dp - 1) * cluster.intra_lat)
    nodes = -(-dp // per_node)
    bw = min(cluster.intra_bw, cluster.inter_bw * per_node / cluster.gpus_per_node)
    return Ring(dp, bw, (per_node - 1) * cluster.intra_lat + (nodes - 1) * cluster.inter_lat)


def tp_ring(cluster: Cluster, tp: int) -> Ring:
    """Tensor (model) parallelism stays inside a node."""
    return Ring(tp, cluster.intra_bw, (tp - 1) * cluster.intra_lat)
