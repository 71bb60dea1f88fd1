"""The CPU tier's core list: the arena's node minus vLLM's bound cores, shared among a host's ranks, refused by name
when nothing is left or a named CPU is not usable."""

from __future__ import annotations

import pytest

from vllm_expert_offload.memory.tier_cpus import TierCpusError, node_share, tier_cpus

USABLE = range(16)
NODE1 = range(8, 16)


def test_auto_takes_the_arena_node_minus_the_engines_cores():
    got = tier_cpus(None, None, USABLE, NODE1, engine_bound={8, 9, 3})
    assert got.cpus == (10, 11, 12, 13, 14, 15) and got.threads == 6
    assert got.describe() == "6 threads on CPUs 10-15"


def test_auto_without_a_node_takes_every_usable_cpu_not_bound():
    assert tier_cpus(None, 2, {0, 1, 5}, (), engine_bound={0}).cpus == (1, 5)


@pytest.mark.parametrize("share, want", [((0, 3), (10, 11)), ((1, 3), (12, 13)), ((2, 3), (14, 15, 16))])
def test_ranks_on_one_host_take_disjoint_contiguous_shares(share, want):
    # 7 free CPUs among 3 ranks: 2, 2, 3 — no CPU given twice, none left out
    got = tier_cpus(None, None, range(20), range(8, 17), engine_bound={8, 9}, share=share)
    assert got.cpus == want


def test_auto_refused_by_name_when_nothing_is_left():
    with pytest.raises(TierCpusError, match=r'cpu_tier\.cpus: "auto" leaves no CPU for this rank \(0 of 1.*'
                                            r"node has CPUs 0-1, vLLM's processes are bound to 0-1"):
        tier_cpus(None, None, {0, 1}, (0, 1), engine_bound={0, 1})
    with pytest.raises(TierCpusError, match=r"rank \(0 of 2"):  # one free CPU, two ranks: one of them gets none
        tier_cpus(None, None, {0, 1}, (), engine_bound={0}, share=(0, 2))


def test_explicit_cpus_are_kept_even_when_the_engine_uses_them_but_must_be_usable():
    assert tier_cpus((0, 1), 1, {0, 1}, (), engine_bound={0, 1}).cpus == (0, 1)
    with pytest.raises(TierCpusError, match=r"cpu_tier\.cpus: CPU 4 is not one this process may run on"):
        tier_cpus((1, 4), None, {0, 1, 2}, (), engine_bound=())


def test_more_threads_than_cpus_refused_by_name():
    with pytest.raises(TierCpusError, match=r"cpu_tier\.threads: 3 threads on the 2 CPUs 10-11"):
        tier_cpus(None, 3, USABLE, (10, 11), engine_bound=())


def test_auto_leaves_reserved_cores_unpinned_before_the_split():
    # a GPU box: node 1 is CPUs 8-15, two ranks there; 3 cores stay for the ranks' Python/callback threads and
    # the engine core, the other 5 are split 2 / 3
    assert tier_cpus(None, None, range(16), NODE1, (), share=(0, 2), reserve=3).cpus == (11, 12)
    assert tier_cpus(None, None, range(16), NODE1, (), share=(1, 2), reserve=3).cpus == (13, 14, 15)
    with pytest.raises(TierCpusError, match=r"8 are left to unpinned threads"):
        tier_cpus(None, None, range(16), NODE1, (), reserve=8)


def test_an_explicit_list_is_split_among_the_hosts_ranks_and_each_must_get_one():
    assert tier_cpus((2, 3, 4, 5, 6), None, range(8), (), (), share=(1, 2)).cpus == (4, 5, 6)
    assert tier_cpus((2, 3, 4, 5, 6), None, range(8), (), (), share=(0, 2)).cpus == (2, 3)
    with pytest.raises(TierCpusError, match=r"cpu_tier\.cpus: 2 is split among the 2 ranks .* leaves rank 0 no"):
        tier_cpus((2,), None, range(8), (), (), share=(0, 2))


@pytest.mark.parametrize("index, nodes, want", [
    (1, [0, 1], (0, 1)),            # TP 2 across two sockets: each rank has its node to itself
    (2, [0, 0, 1, 1], (0, 2)),
    (3, [0, 0, 1, 1], (1, 2)),
    (2, [None, 0, None], (1, 2)),   # unknown nodes count as one node
])
def test_node_share_counts_only_the_ranks_on_the_same_node(index, nodes, want):
    assert node_share(index, nodes) == want
