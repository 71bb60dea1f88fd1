"""Which host cores the CPU expert tier computes on (`expert_offload.cpu_tier.cpus` / `threads`).

The tier's cores should sit on the NUMA node that holds the arena (its records are read there, at DRAM speed, never
across the socket link) and must not be the cores vLLM's own processes are bound to (the CPU engine's compute
threads of every rank), or the tier and the engine would take turns on one core. On a GPU nothing of vLLM's is
bound, but each rank's Python thread (it launches the step's kernels) and CUDA's callback thread (it starts the
tier's jobs) sit on the critical path of every layer, as do the engine core and API server: "auto" leaves them
cores of their own (`reserve`) instead of pinning a spinning pool thread to every core. Ranks whose arenas share a
node share that node's cores; an explicit list is the host's, split among its ranks, so no two pools spin on one
core. A list that leaves nothing, or names CPUs this process may not run on, is refused by name: a tier silently
computing on a busy core would look like a slow kernel.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from ..errors import ExpertOffloadError
from .topology import format_cpulist

WHERE = "--additional-config expert_offload.cpu_tier"


class TierCpusError(ExpertOffloadError, ValueError):
    """The CPU tier's core list is empty or names cores this process cannot use; the message names the key."""


@dataclass(frozen=True)
class TierCpus:
    cpus: tuple[int, ...]
    threads: int

    def describe(self) -> str:
        return f"{self.threads} thread{'s' * (self.threads != 1)} on CPUs {format_cpulist(self.cpus)}"


def tier_cpus(
    requested: Sequence[int] | None, threads: int | None, usable: Collection[int], node_cpus: Sequence[int],
    engine_bound: Collection[int], share: tuple[int, int] = (0, 1), reserve: int = 0,
) -> TierCpus:
    """The tier's cores and thread count.

    `requested`: the `cpus` option (None: "auto"); `threads`: the `threads` option (None: one per core);
    `usable`: the CPUs this process may run threads on (its affinity on a GPU; the online CPUs on the CPU engine,
    whose worker is bound before the model loads); `node_cpus`: the arena's NUMA node's CPUs (empty: no node
    known, every usable CPU counts); `engine_bound`: cores vLLM's own processes are bound to; `share`: (this
    rank's index, ranks) among the ranks that split the list: those whose arena is on this node for "auto", the
    host's for an explicit list; each takes a contiguous share. `reserve`: how many of the node's free cores
    "auto" leaves to unpinned threads (the lowest-numbered), before the split.
    """
    index, ranks = share
    if requested is not None:
        outside = sorted(set(requested) - set(usable))
        if outside:
            raise TierCpusError(f"{WHERE}.cpus: CPU {outside[0]} is not one this process may run on "
                                f"(usable: {format_cpulist(usable)})")
        cpus = _share_of(tuple(requested), index, ranks)
        if not cpus:
            raise TierCpusError(f"{WHERE}.cpus: {format_cpulist(requested)} is split among the {ranks} ranks on "
                                f"this host and leaves rank {index} no CPU; name at least one CPU per rank")
    else:
        free = [c for c in sorted(node_cpus or usable) if c in set(usable) and c not in set(engine_bound)]
        cpus = _share_of(tuple(free[reserve:]), index, ranks)
        if not cpus:
            raise TierCpusError(
                f'{WHERE}.cpus: "auto" leaves no CPU for this rank ({index} of {ranks} on this node): the arena\'s '
                f"node has CPUs {format_cpulist(node_cpus or usable) or 'none'}, vLLM's processes are bound to "
                f"{format_cpulist(engine_bound) or 'none'}, {reserve} are left to unpinned threads; give cpus (and "
                "threads) explicitly")
    if threads is not None and threads > len(cpus):
        raise TierCpusError(f"{WHERE}.threads: {threads} threads on the {len(cpus)} CPUs {format_cpulist(cpus)}; "
                            "give at most one thread per CPU")
    return TierCpus(cpus, len(cpus) if threads is None else threads)


def _share_of(cpus: tuple[int, ...], index: int, ranks: int) -> tuple[int, ...]:
    return cpus[index * len(cpus) // ranks:(index + 1) * len(cpus) // ranks]


def node_share(index: int, nodes: Sequence[int | None]) -> tuple[int, int]:
    """(this rank's index, ranks) among the host's ranks whose arena is on the same node as rank `index`'s;
    `nodes`: each host rank's arena node (None: unknown, counted as one node with the other unknowns)."""
    peers = [rank for rank, node in enumerate(nodes) if node == nodes[index]]
    return peers.index(index), len(peers)
