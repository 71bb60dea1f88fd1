"""The GPU tier as an expert cache on the CPU kernel (issue 26): write-through fills, slot pointer tables, the
budget, and the no-sync proof of a forward with the cache.

References: the same kernel without a cache over the same host records (a cache changes where a trellis is read
from, never its bytes, so outputs are equal bit for bit), the trellises themselves for a slot's content, and the
policy's own assignment (offload/cache_policy.py) for where each table entry must point.
"""

from __future__ import annotations

import pytest
import torch

from vllm_expert_offload.exl3.naming import PROJECTIONS
from vllm_expert_offload.kernels import cpu_exl3
from vllm_expert_offload.kernels.cpu_exl3 import CPU_MATMUL
from vllm_expert_offload.kernels.expert_blocks import grouped_blocks
from vllm_expert_offload.kernels.expert_slots import ExpertSlots, expert_trellis_bytes
from vllm_expert_offload.kernels.matrix_table import matrix_table
from vllm_expert_offload.kernels.pointer_tables import build_pointer_tables, kernel_address, stack_scales
from vllm_expert_offload.kernels.rotated import RotatedMoE
from vllm_expert_offload.kernels.triton_exl3 import TRITON_MATMUL
from vllm_expert_offload.kernels.triton_moe import FusedTritonMoE
from vllm_expert_offload.memory import HostArena
from vllm_expert_offload.offload import counters as tier_counters
from vllm_expert_offload.offload.cache_policy import CacheSettings
from vllm_expert_offload.offload.tiers import host_record_bytes, place_expert, record_layout

from support.meta_proof import (
    BAD_PATTERNS,
    HOST_SYNC_ON_META,
    META,
    assert_all_on_meta,
    forward_on_meta,
    meta_moe_layer,
    meta_routing,
    planted,
)
from support.moe_layers import CPU, FULL, HIDDEN, TIERS, expert_sets

SLOTS = 2  # of 6 experts: top-2 routing over 6 experts must evict


def _host_layer(seed: int = 0):
    """Every expert of the mixed-K test layer in a host record (as with `dynamic` on), its tables and scales."""
    sets = expert_sets(seed)
    arena = HostArena(sum(host_record_bytes(s) for s in sets), device=CPU)
    experts, scales = stack_scales([place_expert(s, False, arena, CPU) for s in sets], CPU)
    tables = build_pointer_tables(experts, kernel_address(arena, CPU), CPU)
    return experts, tables, scales, arena


def _slot_bytes(experts) -> int:
    return max(record_layout(e.projections)[1] for e in experts)


def _cached_moe(settings: CacheSettings, initial=(True, True, False, False, False, False), counters=None):
    experts, tables, scales, arena = _host_layer()
    slots = ExpertSlots(experts, tables, settings, initial, _slot_bytes(experts), CPU, counters)
    return RotatedMoE(experts, tables, scales, arena, FULL, CPU, CPU_MATMUL, cache=slots), slots, experts, arena


def _uncached_moe():
    experts, tables, scales, arena = _host_layer()
    return RotatedMoE(experts, tables, scales, arena, FULL, CPU, CPU_MATMUL), arena


def _steps(count: int, seed: int):
    """Batches of 1 to 40 tokens (decode and prefill, blocks of one expert spanning several 32-row blocks)."""
    gen = torch.Generator().manual_seed(seed)
    for step in range(count):
        tokens = (1, 3, 40, 1, 2, 7)[step % 6]
        x = torch.randn(tokens, HIDDEN, generator=gen)
        ids = torch.stack([torch.randperm(len(TIERS), generator=gen)[:2] for _ in range(tokens)])
        yield x, torch.rand(tokens, 2, generator=gen), ids


def _assert_tables_follow_policy(slots: ExpertSlots, experts, arena: HostArena) -> None:
    """Each expert's trellis entry: its slot (slot base + its record offset) when resident, else its host record;
    and a resident expert's slot holds its trellis bytes (written by the kernel's fill or at load)."""
    slot_of = slots.policy.slot_of_expert.tolist()
    base = slots.pool.data_ptr()
    for e, expert in enumerate(experts):
        offsets, _ = record_layout(expert.projections)
        for p in PROJECTIONS:
            trellis = expert.projections[p].trellis
            entry = int(slots.tables.table(p, "trellis")[e])
            if slot_of[e] < 0:
                assert entry == arena.device_address(arena.offset_of(trellis)), (e, p)
                continue
            assert entry == base + slot_of[e] * slots.slot_bytes + offsets[p], (e, p)
            held = slots.pool[slot_of[e], offsets[p] : offsets[p] + trellis.numel() * 2]
            assert torch.equal(held, trellis.reshape(-1).view(torch.uint8)), f"slot of expert {e} holds other bytes"
    assert slots.tables.in_gpu_tier.tolist() == [s >= 0 for s in slot_of]


def _assert_within_budget(slots: ExpertSlots) -> None:
    slot_of = slots.policy.slot_of_expert
    resident = slot_of[slot_of >= 0]
    assert len(resident) <= slots.pool.shape[0] == SLOTS
    assert len(torch.unique(resident)) == len(resident), "two experts share a slot"
    of_slot = slots.policy.expert_of_slot
    for slot, expert in enumerate(of_slot.tolist()):
        assert expert < 0 or int(slot_of[expert]) == slot


@pytest.mark.parametrize("policy", ["decayed-lfu", "lru"])
def test_cached_forward_equals_uncached_while_fills_and_evictions_happen(policy: str) -> None:
    counters = tier_counters.TierCounters(1, CPU)
    cached, slots, experts, arena = _cached_moe(CacheSettings(policy, 2.0), counters=counters)
    plain, _ = _uncached_moe()
    _assert_tables_follow_policy(slots, experts, arena)  # the plan's GPU experts copied in at load
    for x, weights, ids in _steps(18, seed=3):
        before = slots.policy.slot_of_expert.clone()
        want = plain.forward(x, weights, ids, False)
        got = cached.forward(x, weights, ids, False)
        assert torch.equal(got, want)
        read = torch.zeros(len(TIERS), dtype=torch.bool).index_fill_(0, ids.reshape(-1), True)
        lost = (before != slots.policy.slot_of_expert) & (before >= 0)
        assert not (lost & read).any(), "an expert read in this step lost its slot"
        _assert_tables_follow_policy(slots, experts, arena)
        _assert_within_budget(slots)
    fills, evictions = counters.counts[0, tier_counters.FILLS:tier_counters.EVICTIONS + 1].tolist()
    assert fills > SLOTS and evictions > 0, "the budget is small enough that fills and evictions must happen"


def test_triton_writes_through_and_equals_its_uncached_forward() -> None:
    """The fused Triton kernels with the cache (interpreted, decode sizes): the same outputs as without it, bit for
    bit, while experts are filled into slots by the kernels' own reads and evicted."""
    counters = tier_counters.TierCounters(1, CPU)
    experts, tables, scales, arena = _host_layer()
    slots = ExpertSlots(experts, tables, CacheSettings("lru"), (True, True, False, False, False, False),
                        _slot_bytes(experts), CPU, counters)
    cached = FusedTritonMoE(experts, tables, scales, arena, FULL, torch.float32, CPU, top_k=2, cache=slots)
    plain_experts, plain_tables, plain_scales, plain_arena = _host_layer()
    plain = FusedTritonMoE(plain_experts, plain_tables, plain_scales, plain_arena, FULL, torch.float32, CPU, top_k=2)
    gen = torch.Generator().manual_seed(5)
    for tokens in (1, 3, 1, 2):
        x = torch.randn(tokens, HIDDEN, generator=gen)
        ids = torch.stack([torch.randperm(len(TIERS), generator=gen)[:2] for _ in range(tokens)])
        weights = torch.rand(tokens, 2, generator=gen)
        assert torch.equal(cached.forward(x, weights, ids, False), plain.forward(x, weights, ids, False))
        _assert_tables_follow_policy(slots, experts, arena)
        _assert_within_budget(slots)
    fills, evictions = counters.counts[0, tier_counters.FILLS:tier_counters.EVICTIONS + 1].tolist()
    assert fills >= SLOTS and evictions > 0


def test_off_policy_never_fills_and_keeps_the_initial_slots() -> None:
    cached, slots, experts, arena = _cached_moe(CacheSettings("off"))
    start = slots.policy.slot_of_expert.clone()
    for x, weights, ids in _steps(6, seed=4):
        cached.forward(x, weights, ids, False)
    assert torch.equal(slots.policy.slot_of_expert, start)
    _assert_tables_follow_policy(slots, experts, arena)


@pytest.fixture(params=["baseline", "avx2", "avx512"])
def isa(request):
    """Each instruction-set copy of the CPU kernel the machine has (each has its own write-through code)."""
    module = cpu_exl3.extension()
    chosen = module.exl3_cpu_isa()
    try:
        module.exl3_set_cpu_isa(request.param)
    except RuntimeError as exc:
        assert "does not support" in str(exc)
        pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    module.exl3_set_cpu_isa(chosen)


def test_fill_racing_reads_of_the_same_expert_in_one_launch(isa: str) -> None:
    """Expert 1 is read from its host record by 73 rows (three 32-row blocks of one matrix) and written through into
    a slot in the same launch, beside expert 0: the product is the plain launch's, the slot holds the trellis
    exactly (written once, by one block), and nothing else of the pool changed."""
    experts, tables, _, _ = _host_layer(seed=2)
    layers = [e.projections["gate"] for e in experts]
    table = matrix_table(layers, tables.table("gate", "trellis"), CPU)
    ids = torch.tensor([1] * 70 + [0] * 5 + [1] * 3)
    a = torch.randn(len(ids), table.in_features)
    blocks = grouped_blocks(ids, len(experts), CPU_MATMUL.block_m)
    want = torch.zeros(len(ids), table.out_features)
    CPU_MATMUL.launch(a, *blocks, table, want)
    nbytes = layers[1].trellis.numel() * 2
    pool = torch.full((nbytes + 256,), 0xA5, dtype=torch.uint8)
    fill = torch.zeros(len(experts), dtype=torch.int64)
    fill[1] = pool.data_ptr() + 128
    got = torch.zeros_like(want)
    CPU_MATMUL.launch(a, *blocks, table, got, fill)
    assert torch.equal(got, want)
    assert torch.equal(pool[128 : 128 + nbytes], layers[1].trellis.reshape(-1).view(torch.uint8))
    assert (pool[:128] == 0xA5).all() and (pool[128 + nbytes :] == 0xA5).all()


def test_fill_table_of_the_wrong_size_is_refused() -> None:
    experts, tables, _, _ = _host_layer()
    layers = [e.projections["gate"] for e in experts]
    table = matrix_table(layers, tables.table("gate", "trellis"), CPU)
    ids = torch.tensor([0, 1])
    out = torch.zeros(2, table.out_features)
    with pytest.raises(RuntimeError, match="fill must be"):
        CPU_MATMUL.launch(torch.randn(2, table.in_features), *grouped_blocks(ids, len(experts), 32), table, out,
                          torch.zeros(len(experts) + 1, dtype=torch.int64))


def test_a_launcher_without_write_through_refuses_a_cache() -> None:
    experts, tables, scales, arena = _host_layer()
    slots = ExpertSlots(experts, tables, CacheSettings(), [True] * SLOTS + [False] * 4, _slot_bytes(experts), CPU)
    with pytest.raises(ValueError, match="triton launcher cannot write an expert through"):
        RotatedMoE(experts, tables, scales, arena, FULL, CPU, TRITON_MATMUL, cache=slots)


def test_read_counters_by_tier_and_host_bytes() -> None:
    counters = tier_counters.TierCounters(2, CPU)
    resident = torch.tensor([True, False, False, True])
    sizes = torch.tensor([10, 20, 40, 80])
    counters.count_reads(1, torch.tensor([[0, 1], [1, 2], [3, 1]]), resident, sizes)
    assert counters.counts[1].tolist() == [2, 4, 60, 0, 0, 0] and counters.counts[0].tolist() == [0] * 6
    counters.count_fills(1, torch.tensor([2, -1]), torch.tensor([3, -1]))
    assert counters.counts[1].tolist() == [2, 4, 60, 1, 1, 0]
    counters.count_reads(0, torch.tensor([[-1, 3], [-1, -1]]), resident, sizes)  # -1: another EP rank's expert
    assert counters.counts[0].tolist() == [1, 0, 0, 0, 0, 0]
    counters.count_cpu_reads(0, torch.tensor([[2, -1], [1, 2]]))  # -1: the device's entry
    assert counters.counts[0].tolist() == [1, 0, 0, 0, 0, 3]
    experts = _host_layer()[0]
    assert expert_trellis_bytes(experts, CPU).tolist() == [
        sum(layer.trellis.numel() * 2 for layer in e.projections.values()) for e in experts]


# --- no host synchronisation with the cache (CUDA-graph capture) ---------------------------------------


def _meta_cached_moe():
    layer = meta_moe_layer(expert_sets(0), FULL)
    slots = ExpertSlots(layer.experts, layer.tables, CacheSettings(), [True] * SLOTS + [False] * 4,
                        _slot_bytes(layer.experts), META, tier_counters.TierCounters(1, META))
    return RotatedMoE(layer.experts, layer.tables, layer.scales, None, FULL, META, CPU_MATMUL, cache=slots), slots


@pytest.mark.parametrize("tokens", [1, 20])
@pytest.mark.parametrize("policy", ["decayed-lfu", "lru"])
def test_cached_forward_runs_with_every_tensor_on_meta(tokens: int, policy: str) -> None:
    layer = meta_moe_layer(expert_sets(0), FULL)
    counters = tier_counters.TierCounters(1, META)
    slots = ExpertSlots(layer.experts, layer.tables, CacheSettings(policy), [True] * SLOTS + [False] * 4,
                        _slot_bytes(layer.experts), META, counters)
    moe = RotatedMoE(layer.experts, layer.tables, layer.scales, None, FULL, META, CPU_MATMUL, cache=slots)
    assert_all_on_meta(moe)
    x, weights, ids = meta_routing(tokens, 2, HIDDEN)
    counters.count_reads(0, ids, layer.tables.in_gpu_tier, expert_trellis_bytes(layer.experts, META))
    assert forward_on_meta(moe.forward, x, weights, ids, False).shape == (tokens, HIDDEN)


@pytest.mark.parametrize("pattern", ["item", "tolist", "boolean-mask indexing", "nonzero", ".cpu()"])
def test_meta_proof_rejects_a_host_sync_planted_in_the_cache_step(monkeypatch: pytest.MonkeyPatch,
                                                                   pattern: str) -> None:
    moe, slots = _meta_cached_moe()
    monkeypatch.setattr(slots, "begin", planted(slots.begin, BAD_PATTERNS[pattern]))
    with pytest.raises(HOST_SYNC_ON_META, match="(?i)meta"):
        moe.forward(*meta_routing(3, 2, HIDDEN), False)
