"""Host memory for host-tier experts: one GPU-mapped arena, bound to the GPU's NUMA node."""

from .arena import RECORD_ALIGNMENT, ArenaFullError, HostArena, align_up
from .topology import TopologyReport, format_report, numa_node_of_gpu, system_report, topology_report

__all__ = [
    "RECORD_ALIGNMENT",
    "ArenaFullError",
    "HostArena",
    "TopologyReport",
    "align_up",
    "format_report",
    "numa_node_of_gpu",
    "system_report",
    "topology_report",
]
