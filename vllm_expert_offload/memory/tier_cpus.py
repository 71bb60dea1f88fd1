"""Which host cores the CPU expert tier computes on (`expert_offload.cpu_tier.cpus` / `threads`).

The tier's cores should sit on the NUMA node that holds the arena (its records are read there, at DRAM speed, never
across the socket link) and must not be the cores vLLM's own processes are bound to (the CPU engine's compute
threads of every rank), or the tier and the engine would take turns on one core. With several ranks on one host
each takes its own share of what is left. A list that leaves nothing, or names CPUs this process may not run on,
is refused by name: a tier silently computing on a busy core would look like a slow kernel.
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
    engine_bound: Collection[int], share: tuple[int, int] = (0, 1),
) -> TierCpus:
    """The tier's cores and thread count.

    `requested`: the `cpus` option (None: "auto"); `threads`: the `threads` option (None: one per core);
    `usable`: the CPUs this process may run threads on (os.sched_getaffinity before vLLM binds anything, or the
    online CPUs); `node_cpus`: the arena's NUMA node's CPUs (empty: no node known, every usable CPU counts);
    `engine_bound`: cores vLLM's own processes are bound to; `share`: (this rank's index, ranks) among the ranks
    on this host that each take a contiguous share of the automatic list.
    """
    if requested is not None:
        outside = sorted(set(requested) - set(usable))
        if outside:
            raise TierCpusError(f"{WHERE}.cpus: CPU {outside[0]} is not one this process may run on "
                                f"(usable: {format_cpulist(usable)})")
        cpus = tuple(requested)
    else:
        index, ranks = share
        pool = [c for c in sorted(node_cpus or usable) if c in set(usable) and c not in set(engine_bound)]
        cpus = tuple(pool[index * len(pool) // ranks:(index + 1) * len(pool) // ranks])
        if not cpus:
            raise TierCpusError(
                f'{WHERE}.cpus: "auto" leaves no CPU for this rank ({index} of {ranks} on this host): the arena\'s '
                f"node has CPUs {format_cpulist(node_cpus or usable) or 'none'}, vLLM's processes are bound to "
                f"{format_cpulist(engine_bound) or 'none'}; give cpus (and threads) explicitly")
    if threads is not None and threads > len(cpus):
        raise TierCpusError(f"{WHERE}.threads: {threads} threads on the {len(cpus)} CPUs {format_cpulist(cpus)}; "
                            "give at most one thread per CPU")
    return TierCpus(cpus, len(cpus) if threads is None else threads)
