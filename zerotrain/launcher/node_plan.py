"""The job's node table: which hosts run how many ranks, and which global ranks those are.

DeepSpeed's layout: nodes in hostfile order, ranks contiguous per node, so node
``i`` runs global ranks ``first_rank .. first_rank + len(slots) - 1``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Node:
    """One node of a job, as the launcher starts it."""

    host: str
    """The host name exactly as the hostfile (or nodelist) spells it; ssh resolves it."""
    slots: tuple[int, ...]
    """The slot (GPU) indices this node runs ranks on, one rank per slot, in order."""
    node_rank: int
    """Position of the node in the job: 0 hosts the rendezvous."""
    first_rank: int
    """Global rank of this node's local rank 0."""

    @property
    def nproc(self) -> int:
        return len(self.slots)

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.nproc)


def plan_nodes(selection: Mapping[str, Sequence[int]]) -> list[Node]:
    """Nodes in `selection`'s order (host -> slots), ranks numbered contiguously per node."""
    nodes: list[Node] = []
    first = 0
    for node_rank, (host, slots) in enumerate(selection.items()):
        nodes.append(Node(host=host, slots=tuple(slots), node_rank=node_rank, first_rank=first))
        first += len(slots)
    return nodes


def world_size(nodes: Sequence[Node]) -> int:
    return sum(node.nproc for node in nodes)
