"""`topology`: which NUMA node each GPU hangs off, and whether a given arena node matches it.

Run it on the serving machine before choosing the arena's node: a host arena on the wrong socket makes
every host-tier expert read cross the socket interconnect on top of PCIe.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..memory.topology import format_report, system_report


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "topology", help="show each GPU's PCI address, NUMA node and CPUs",
        description="Reads sysfs (and `nvidia-smi topo -m` when installed); GPUs are numbered as CUDA numbers "
        "them in this process.",
    )
    parser.add_argument("--arena-node", type=int, default=None,
                        help="NUMA node the host arena will be bound to; warns for GPUs on another node")
    parser.add_argument("--sysfs-root", type=Path, default=Path("/"), help=argparse.SUPPRESS)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    print(format_report(system_report(args.sysfs_root, arena_node=args.arena_node)))
    return 0
