"""Which NUMA node each GPU hangs off, from sysfs (and `nvidia-smi topo -m` when it is installed).

Host-tier experts are read by the GPU over PCIe on every forward; if their arena sits on the other socket,
every read also crosses the inter-socket link. The arena must be bound to its GPU's node, and this module
says which node that is. Every sysfs read takes `root` so tests can point at a fake tree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

NVIDIA_VENDOR = 0x10DE
GPU_PCI_CLASSES = (0x0300, 0x0302)  # VGA-compatible controller, 3D controller (data-center GPUs)
PCI_DEVICES = "sys/bus/pci/devices"
NUMA_NODES = "sys/devices/system/node"


def parse_cpulist(text: str) -> tuple[int, ...]:
    """The kernel's list format ("0-3,8,10-11"), used for CPU lists and node lists alike."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        out.extend(range(int(first), int(last or first) + 1))
    return tuple(out)


def format_cpulist(values: Sequence[int]) -> str:
    """Inverse of parse_cpulist, with ranges collapsed."""
    runs: list[list[int]] = []
    for v in sorted(values):
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def online_numa_nodes(root: str | Path = "/") -> tuple[int, ...]:
    """Online NUMA nodes; empty when the kernel exposes none (built without NUMA)."""
    return parse_cpulist(_read(Path(root) / NUMA_NODES / "online") or "")


def node_free_bytes(node: int, root: str | Path = "/") -> int | None:
    """MemFree of one NUMA node from its meminfo ("Node 0 MemFree:  123 kB"); None when not exposed."""
    for line in (_read(Path(root) / NUMA_NODES / f"node{node}" / "meminfo") or "").splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] == "MemFree:":
            return int(fields[3]) * 1024
    return None


def node_cpus(node: int, root: str | Path = "/") -> tuple[int, ...]:
    return parse_cpulist(_read(Path(root) / NUMA_NODES / f"node{node}" / "cpulist") or "")


def normalize_pci_address(address: str) -> str:
    """sysfs form "0000:3b:00.0"; nvidia-smi and CUDA print an 8-digit upper-case domain."""
    domain, bus, rest = address.strip().lower().split(":")
    return f"{int(domain, 16):04x}:{bus}:{rest}"


@dataclass(frozen=True)
class PciGpu:
    pci_address: str
    numa_node: int | None  # None: the firmware did not say (sysfs -1 or no numa_node file)
    cpus: tuple[int, ...]  # CPUs of that node; empty when the node is unknown


def _pci_gpu(device_dir: Path, root: str | Path) -> PciGpu:
    raw = _read(device_dir / "numa_node")
    node = int(raw) if raw is not None and int(raw) >= 0 else None
    return PciGpu(device_dir.name, node, node_cpus(node, root) if node is not None else ())


def scan_pci_gpus(root: str | Path = "/") -> list[PciGpu]:
    """NVIDIA display/3D controllers in PCI address order (the order nvidia-smi numbers them)."""
    devices = Path(root) / PCI_DEVICES
    gpus = []
    for device_dir in sorted(devices.iterdir()) if devices.is_dir() else ():
        vendor, pci_class = _read(device_dir / "vendor"), _read(device_dir / "class")
        if vendor and pci_class and int(vendor, 16) == NVIDIA_VENDOR and int(pci_class, 16) >> 8 in GPU_PCI_CLASSES:
            gpus.append(_pci_gpu(device_dir, root))
    return gpus


def cuda_pci_addresses() -> list[str] | None:
    """PCI addresses in torch.cuda index order (after CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER); None without CUDA."""
    if not torch.cuda.is_available():
        return None
    addresses = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        addresses.append(f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0")
    return addresses


def gpus_in_cuda_order(
    pci_gpus: Sequence[PciGpu], cuda_order: Sequence[str] | None, visible_devices: str | None
) -> tuple[list[PciGpu], str | None]:
    """GPUs indexed as CUDA numbers them, plus a note when that order is a guess.

    With CUDA the driver's own order is used. Without it, integer CUDA_VISIBLE_DEVICES entries are applied to
    the PCI order, which is CUDA's order only for identical GPUs or CUDA_DEVICE_ORDER=PCI_BUS_ID.
    """
    if cuda_order is not None:
        by_address = {g.pci_address: g for g in pci_gpus}
        addresses = [normalize_pci_address(a) for a in cuda_order]
        return [by_address.get(a, PciGpu(a, None, ())) for a in addresses], None
    if visible_devices is None:
        return list(pci_gpus), None
    entries = [e.strip() for e in visible_devices.split(",") if e.strip()]
    if not all(e.isdigit() for e in entries):
        return list(pci_gpus), f"CUDA_VISIBLE_DEVICES={visible_devices!r} names GPUs by UUID; listing them in PCI order"
    selected = []
    for entry in entries:  # CUDA stops at the first invalid ordinal
        if int(entry) >= len(pci_gpus):
            break
        selected.append(pci_gpus[int(entry)])
    return selected, "without CUDA, CUDA_VISIBLE_DEVICES was applied to the PCI order"


def numa_node_of_gpu(index: int, root: str | Path = "/") -> int | None:
    """NUMA node of CUDA device `index` in this process; None when the firmware does not report one."""
    gpus, _ = gpus_in_cuda_order(scan_pci_gpus(root), cuda_pci_addresses(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    if not 0 <= index < len(gpus):
        raise IndexError(f"GPU index {index} out of range: {len(gpus)} NVIDIA GPU(s) visible")
    return gpus[index].numa_node


@dataclass(frozen=True)
class SmiGpuAffinity:
    """One GPU row of `nvidia-smi topo -m` (nvidia-smi's own numbering: PCI order, all GPUs)."""

    name: str
    cpu_affinity: tuple[int, ...]  # empty for N/A
    numa_affinity: tuple[int, ...]  # empty for N/A


def parse_nvidia_smi_topo(text: str) -> list[SmiGpuAffinity]:
    """GPU rows of the tab-separated matrix; the header names the columns, so their order may vary by version."""
    header: list[str] | None = None
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("\t")]
        if header is None:
            if "CPU Affinity" in cells:
                header = cells
            continue
        if not cells[0].startswith("GPU"):
            if not cells[0]:
                break  # blank line: the legend follows
            continue
        row = dict(zip(header[1:], cells[1:]))
        rows.append(SmiGpuAffinity(cells[0], _affinity(row, "CPU Affinity"), _affinity(row, "NUMA Affinity")))
    return rows


def _affinity(row: dict[str, str], column: str) -> tuple[int, ...]:
    value = row.get(column, "N/A")
    return () if value in ("", "N/A") else parse_cpulist(value)


def run_nvidia_smi_topo() -> str | None:
    """`nvidia-smi topo -m` output, or None when the binary is missing or fails."""
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return None
    try:
        done = subprocess.run([binary, "topo", "-m"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


@dataclass(frozen=True)
class GpuTopology:
    index: int  # CUDA index
    pci_address: str
    numa_node: int | None
    cpus: tuple[int, ...]


@dataclass(frozen=True)
class TopologyReport:
    gpus: tuple[GpuTopology, ...]
    numa_nodes: tuple[int, ...]
    smi: tuple[SmiGpuAffinity, ...] | None  # None: nvidia-smi not available
    arena_node: int | None
    notes: tuple[str, ...]
    warnings: tuple[str, ...]


def topology_report(
    root: str | Path = "/",
    *,
    cuda_order: Sequence[str] | None = None,
    visible_devices: str | None = None,
    smi_text: str | None = None,
    arena_node: int | None = None,
) -> TopologyReport:
    """Pure assembly from the given inputs (see system_report for the live ones)."""
    ordered, note = gpus_in_cuda_order(scan_pci_gpus(root), cuda_order, visible_devices)
    gpus = tuple(GpuTopology(i, g.pci_address, g.numa_node, g.cpus) for i, g in enumerate(ordered))
    nodes = online_numa_nodes(root)
    warnings = []
    for gpu in gpus:
        if gpu.numa_node is None and len(nodes) > 1:
            warnings.append(f"GPU {gpu.index} ({gpu.pci_address}): the firmware reports no NUMA node on a "
                            f"{len(nodes)}-node machine; the arena's placement cannot be checked")
        elif arena_node is not None and gpu.numa_node is not None and gpu.numa_node != arena_node:
            warnings.append(f"GPU {gpu.index} ({gpu.pci_address}) is on NUMA node {gpu.numa_node}, but the arena is "
                            f"bound to node {arena_node}: every host-tier expert read crosses the socket interconnect")
    smi = None if smi_text is None else tuple(parse_nvidia_smi_topo(smi_text))
    return TopologyReport(gpus, nodes, smi, arena_node, (note,) if note else (), tuple(warnings))


def system_report(root: str | Path = "/", arena_node: int | None = None) -> TopologyReport:
    """The report for this machine and process: torch.cuda's device order, CUDA_VISIBLE_DEVICES, nvidia-smi."""
    return topology_report(
        root,
        cuda_order=cuda_pci_addresses(),
        visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        smi_text=run_nvidia_smi_topo(),
        arena_node=arena_node,
    )


def _node_text(node: int | None) -> str:
    return "unknown" if node is None else str(node)


def format_report(report: TopologyReport) -> str:
    nodes = format_cpulist(report.numa_nodes) if report.numa_nodes else "none reported"
    lines = [f"NUMA nodes online: {nodes}"]
    if report.arena_node is not None:
        lines.append(f"arena NUMA node: {report.arena_node}")
    if not report.gpus:
        lines.append(f"no NVIDIA GPU found (no PCI device with vendor {NVIDIA_VENDOR:#06x} and class "
                     f"{'/'.join(f'{c:#06x}' for c in GPU_PCI_CLASSES)})")
    for gpu in report.gpus:
        cpus = f"  CPUs {format_cpulist(gpu.cpus)}" if gpu.cpus else ""
        lines.append(f"GPU {gpu.index}  {gpu.pci_address}  NUMA node {_node_text(gpu.numa_node)}{cpus}")
    if report.smi is not None:
        lines.append("nvidia-smi topo -m:")
        for row in report.smi:
            lines.append(f"  {row.name}  CPU affinity {format_cpulist(row.cpu_affinity) or 'N/A'}  "
                         f"NUMA affinity {format_cpulist(row.numa_affinity) or 'N/A'}")
    lines += [f"note: {n}" for n in report.notes]
    lines += [f"warning: {w}" for w in report.warnings]
    return "\n".join(lines)
