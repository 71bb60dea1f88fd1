"""GPU <-> NUMA topology against fake sysfs trees and a captured `nvidia-smi topo -m`."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_expert_offload.cli import main
from vllm_expert_offload.memory import topology
from vllm_expert_offload.memory.topology import (
    format_report,
    gpus_in_cuda_order,
    parse_cpulist,
    parse_nvidia_smi_topo,
    scan_pci_gpus,
    topology_report,
)

GPU0, GPU1 = "0000:1b:00.0", "0000:9a:00.0"

# `nvidia-smi topo -m` of a 2-socket, 2-GPU, 1-NIC host (tab-separated, as the tool prints it).
SMI_SAMPLE = (
    "\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\n"
    "GPU0\t X \tSYS\tNODE\t0-31,64-95\t0\t\tN/A\n"
    "GPU1\tSYS\t X \tSYS\t32-63,96-127\t1\t\tN/A\n"
    "NIC0\tNODE\tSYS\t X \t\t\t\t\n"
    "\n"
    "Legend:\n"
    "\n"
    "  X    = Self\n"
    "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)\n"
    "  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node\n"
    "\n"
    "NIC Legend:\n"
    "\n"
    "  NIC0: mlx5_0\n"
)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def pci_device(root: Path, address: str, vendor: str, pci_class: str, numa_node: str | None) -> None:
    device = root / topology.PCI_DEVICES / address
    _write(device / "vendor", vendor)
    _write(device / "class", pci_class)
    if numa_node is not None:
        _write(device / "numa_node", numa_node)


@pytest.fixture
def two_socket(tmp_path: Path) -> Path:
    """Nodes 0/1, a GPU on each (one 3D controller, one VGA), plus an Intel NIC and an NVIDIA audio function."""
    nodes = tmp_path / topology.NUMA_NODES
    _write(nodes / "online", "0-1")
    _write(nodes / "node0" / "cpulist", "0-31,64-95")
    _write(nodes / "node1" / "cpulist", "32-63,96-127")
    pci_device(tmp_path, GPU1, "0x10de", "0x030000", "1")
    pci_device(tmp_path, GPU0, "0x10de", "0x030200", "0")
    pci_device(tmp_path, "0000:1b:00.1", "0x10de", "0x040300", "0")  # the GPU's HDMI audio function
    pci_device(tmp_path, "0000:31:00.0", "0x8086", "0x020000", "0")
    return tmp_path


def test_cpulist_round_trip() -> None:
    assert parse_cpulist("0-3,8,10-11\n") == (0, 1, 2, 3, 8, 10, 11)
    assert topology.format_cpulist((11, 0, 1, 2, 3, 8, 10)) == "0-3,8,10-11"
    assert parse_cpulist("") == ()


def test_two_gpus_on_two_nodes(two_socket: Path) -> None:
    gpus = scan_pci_gpus(two_socket)
    assert [g.pci_address for g in gpus] == [GPU0, GPU1]
    assert [g.numa_node for g in gpus] == [0, 1]
    assert gpus[1].cpus == tuple(range(32, 64)) + tuple(range(96, 128))
    report = topology_report(two_socket)
    assert report.numa_nodes == (0, 1) and report.warnings == ()
    text = format_report(report)
    assert f"GPU 0  {GPU0}  NUMA node 0  CPUs 0-31,64-95" in text
    assert f"GPU 1  {GPU1}  NUMA node 1  CPUs 32-63,96-127" in text


def test_arena_on_other_node_warns(two_socket: Path) -> None:
    report = topology_report(two_socket, arena_node=0)
    assert len(report.warnings) == 1
    assert f"GPU 1 ({GPU1}) is on NUMA node 1, but the arena is bound to node 0" in report.warnings[0]
    assert "warning: GPU 1" in format_report(report)


@pytest.mark.parametrize("numa_file", [None, "-1"])
def test_unknown_numa_node(two_socket: Path, numa_file: str | None) -> None:
    (two_socket / topology.PCI_DEVICES / GPU1 / "numa_node").unlink()
    if numa_file is not None:
        _write(two_socket / topology.PCI_DEVICES / GPU1 / "numa_node", numa_file)
    gpu = scan_pci_gpus(two_socket)[1]
    assert gpu.numa_node is None and gpu.cpus == ()
    report = topology_report(two_socket, arena_node=0)
    assert "NUMA node unknown" in format_report(report)
    assert any("reports no NUMA node on a 2-node machine" in w for w in report.warnings)


def test_no_gpu(tmp_path: Path) -> None:
    pci_device(tmp_path, "0000:31:00.0", "0x8086", "0x020000", "-1")
    text = format_report(topology_report(tmp_path))
    assert "no NVIDIA GPU found" in text
    assert "NUMA nodes online: none reported" in text
    assert "no NVIDIA GPU found" in format_report(topology_report(tmp_path / "missing"))


def test_cuda_order_and_visible_devices(two_socket: Path) -> None:
    pci = scan_pci_gpus(two_socket)
    ordered, note = gpus_in_cuda_order(pci, ["00000000:9A:00.0", "00000000:1B:00.0"], "0,1")
    assert [g.numa_node for g in ordered] == [1, 0] and note is None
    ordered, note = gpus_in_cuda_order(pci, None, "1")
    assert [g.pci_address for g in ordered] == [GPU1] and "PCI order" in note
    ordered, note = gpus_in_cuda_order(pci, None, "GPU-5e2c0a1b-0000-0000-0000-000000000000")
    assert len(ordered) == 2 and "UUID" in note


def test_numa_node_of_gpu(two_socket: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(topology, "cuda_pci_addresses", lambda: None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert topology.numa_node_of_gpu(0, two_socket) == 1
    assert topology.numa_node_of_gpu(1, two_socket) == 0
    with pytest.raises(IndexError, match="2 NVIDIA GPU"):
        topology.numa_node_of_gpu(2, two_socket)


def test_parse_nvidia_smi_topo() -> None:
    rows = parse_nvidia_smi_topo(SMI_SAMPLE)
    assert [r.name for r in rows] == ["GPU0", "GPU1"]
    assert rows[0].cpu_affinity == tuple(range(32)) + tuple(range(64, 96))
    assert rows[0].numa_affinity == (0,) and rows[1].numa_affinity == (1,)
    na = parse_nvidia_smi_topo("\tGPU0\tCPU Affinity\tNUMA Affinity\nGPU0\t X \t0-7\tN/A\n")
    assert na[0].cpu_affinity == tuple(range(8)) and na[0].numa_affinity == ()
    text = format_report(topology_report(Path("/nonexistent"), smi_text=SMI_SAMPLE))
    assert "GPU1  CPU affinity 32-63,96-127  NUMA affinity 1" in text


def test_topology_command(two_socket: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(topology, "cuda_pci_addresses", lambda: None)
    monkeypatch.setattr(topology, "run_nvidia_smi_topo", lambda: None)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert main(["topology", "--sysfs-root", str(two_socket), "--arena-node", "1"]) == 0
    out = capsys.readouterr().out
    assert "arena NUMA node: 1" in out and "GPU 0 (0000:1b:00.0) is on NUMA node 0" in out
