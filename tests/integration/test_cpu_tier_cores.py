"""Which cores the CPU tier's pool gets on a GPU box, from vLLM's parallel config and the machine's topology:
every data-parallel engine's workers take disjoint shares (vLLM's GPU worker folds the DP rank into local_rank),
ranks on different sockets each keep their node, "auto" leaves cores to the threads that launch the step, and
only CPUs this process may run on are used."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_expert_offload.integration.methods import cpu_tier_step
from vllm_expert_offload.integration.methods.cpu_tier_step import engine_host_share, resolve_tier_cpus
from vllm_expert_offload.memory.tier_cpus import TierCpusError
from vllm_expert_offload.offload.cpu_tier import CpuTierSettings

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("folded", [False, True])
def test_every_dp_engines_workers_get_disjoint_host_shares(folded: bool) -> None:
    # DP 2 x TP 2 on one host; the GPU worker's local_rank is dp_local * 2 + tp_rank, the CPU worker's tp_rank
    shares = {engine_host_share(dp * 2 * folded + tp, 2, dp, dp, 2, 2) for dp in (0, 1) for tp in (0, 1)}
    assert shares == {(0, 4), (1, 4), (2, 4), (3, 4)}
    assert engine_host_share(1, 2, None, 0, 1, 1) == (1, 2)  # no DP: the rank within the engine


def _placement(cpus=None, threads=None, node=1):
    return SimpleNamespace(options=SimpleNamespace(cpu_tier=CpuTierSettings(cpus=cpus, threads=threads)),
                           arena=SimpleNamespace(numa_node=node))


@pytest.fixture
def two_sockets(monkeypatch: pytest.MonkeyPatch):
    """CPUs 0-7 on node 0 (GPU 0), 8-15 on node 1 (GPU 1); the process may run anywhere."""
    monkeypatch.setattr(cpu_tier_step.os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(cpu_tier_step, "node_cpus", lambda node: tuple(range(8 * node, 8 * node + 8)))
    monkeypatch.setattr(cpu_tier_step, "numa_node_of_gpu", lambda index: index)
    cpu_tier_step._host_rank_nodes.cache_clear()  # the process's lookups, cached, came from the real topology
    yield monkeypatch
    cpu_tier_step._host_rank_nodes.cache_clear()


def test_tp2_across_two_sockets_keeps_each_node_but_leaves_cores_unpinned(two_sockets) -> None:
    got = resolve_tier_cpus(_placement(node=1), CUDA, (1, 2))
    assert got.cpus == tuple(range(10, 16))  # node 1 minus its rank's core and the engine core's
    assert resolve_tier_cpus(_placement(node=0), CUDA, (0, 2)).cpus == tuple(range(2, 8))


def test_an_explicit_list_is_split_between_two_ranks_and_must_be_in_the_affinity(two_sockets) -> None:
    assert resolve_tier_cpus(_placement(cpus=(4, 5, 6, 7)), CUDA, (1, 2)).cpus == (6, 7)
    two_sockets.setattr(cpu_tier_step.os, "sched_getaffinity", lambda pid: set(range(4)))  # a cpuset container
    with pytest.raises(TierCpusError, match=r"cpu_tier\.cpus: CPU 4 is not one this process may run on"):
        resolve_tier_cpus(_placement(cpus=(4, 5, 6, 7)), CUDA, (0, 1))
    with pytest.raises(TierCpusError, match=r'"auto" leaves no CPU'):  # node 1 is outside the affinity
        resolve_tier_cpus(_placement(node=1), CUDA, (0, 1))
