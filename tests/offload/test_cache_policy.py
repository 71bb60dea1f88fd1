"""The expert cache's policy (offload/cache_policy.py): hand-computed LRU and decayed-LFU scenarios, the slot
invariants against a plain-Python reference on random routing, determinism, fixed shapes and the no-sync proof."""

from __future__ import annotations

import random

import pytest
import torch
from support.meta_proof import BAD_PATTERNS, HOST_SYNC_ON_META, META, planted
from support.moe_layers import NoHostSync

from vllm_expert_offload.offload.cache_policy import (
    POLICIES,
    CacheSettings,
    CacheSettingsError,
    ExpertCache,
    parse_cache_settings,
)


def _step(cache: ExpertCache, ids: list[list[int]]) -> tuple[list[int], list[int], list[int], int, int]:
    s = cache.step(torch.tensor(ids))
    return s.fill_expert.tolist(), s.fill_slot.tolist(), s.evicted.tolist(), int(s.hits), int(s.misses)


def test_lru_installs_what_it_read_and_evicts_the_least_recent() -> None:
    cache = ExpertCache(CacheSettings("lru"), num_experts=6, slots=2, device="cpu")
    # empty slots take the misses, in expert order
    assert _step(cache, [[0, 1]]) == ([0, 1], [0, 1], [-1, -1], 0, 2)
    # 0 hits; 2 replaces 1, read one token earlier than 0
    assert _step(cache, [[2, 0]]) == ([2, -1], [1, -1], [1, -1], 1, 1)
    # 0 and 2 were last read by the same token: the lower id goes first, and the newcomers come in id order
    assert _step(cache, [[3, 4]]) == ([3, 4], [0, 1], [0, 2], 0, 2)
    # both residents are read in this forward: nothing may be evicted, so the misses are not installed
    assert _step(cache, [[4, 5], [3, 1]]) == ([-1, -1], [-1, -1], [-1, -1], 2, 2)
    # 4 was last read at token 4, 3 at token 5 (the second token of that forward): 4 goes first
    assert _step(cache, [[2, 1]]) == ([1, 2], [1, 0], [4, 3], 0, 2)
    assert cache.slot_of_expert.tolist() == [-1, 1, 0, -1, -1, -1]
    assert cache.expert_of_slot.tolist() == [2, 1]


def test_decayed_lfu_refuses_a_rare_newcomer_until_recency_serves_the_layer_better() -> None:
    # half-life 1 token: the recency count halves per token, the frequency count (64 half-lives) barely moves
    cache = ExpertCache(CacheSettings("decayed-lfu", half_life_tokens=1.0), num_experts=4, slots=1, device="cpu")
    assert _step(cache, [[0]]) == ([0], [0], [-1], 0, 1)
    for _ in range(2):
        assert _step(cache, [[0]]) == ([-1], [-1], [-1], 1, 0)
    # 1 has read count 1 against 0's decayed ~2.94 at the frequency scale, which ranks while neither scale has
    # served the layer better: 1 is read from host and not installed (LRU would have installed it)
    assert _step(cache, [[1]]) == ([-1], [-1], [-1], 0, 1)
    # before this forward the recency scale ranked 1 first (1 > 0.875) and the frequency scale 0 (2.94 > 1): the read
    # of 1 is a hit for recency only, so the layer now ranks by recency, where 1 (1.5) beats 0 (0.4375)
    assert _step(cache, [[1]]) == ([1], [0], [0], 0, 1)
    assert cache.slot_of_expert.tolist() == [-1, 0, -1, -1]


def test_decayed_lfu_evicts_the_lowest_count_and_never_a_selected_expert() -> None:
    cache = ExpertCache(CacheSettings("decayed-lfu", half_life_tokens=4.0), num_experts=5, slots=2, device="cpu")
    _step(cache, [[0, 1]])
    _step(cache, [[0, 3]])  # 3 replaces 1 (0 is selected; 1's count has decayed below 3's fresh read)
    assert cache.expert_of_slot.tolist() == [0, 3]
    # 0 is selected, so 3 is the only evictable resident; 2 and 4 both count 1, above 3's decayed count: the lower
    # id, 2, replaces 3, and 4 stays on host
    assert _step(cache, [[0, 2], [4, 0]]) == ([2, -1], [1, -1], [3, -1], 2, 2)


@pytest.mark.parametrize(("incumbent_reads", "admitted"), [(1, True), (2, False), (3, False)])
def test_decayed_lfu_admission_at_a_tied_score_keeps_the_incumbent(incumbent_reads: int, admitted: bool) -> None:
    # half-life 1/64 token: the frequency scale (64 half-lives) halves per token and the recency scale falls by 2**-64,
    # both exact in float64, so the counts below tie exactly rather than to rounding. Neither scale has served the
    # layer better (every read so far went to the resident, the top expert of both scales), so frequency ranks.
    initial = torch.tensor([0, -1, -1], dtype=torch.int32)
    cache = ExpertCache(CacheSettings("decayed-lfu", half_life_tokens=1 / 64), num_experts=3, slots=1, device="cpu",
                        initial=initial)
    assert _step(cache, [[0]] * incumbent_reads) == ([-1], [-1], [-1], incumbent_reads, 0)
    # one token later the resident's count is incumbent_reads / 2 against the newcomer's fresh 1: the newcomer is
    # installed only when it ranks strictly above; at 1 = 2 / 2 the incumbent stays (no churn between equals)
    fill = ([1], [0], [0]) if admitted else ([-1], [-1], [-1])
    assert _step(cache, [[1]]) == (*fill, 0, 1)
    assert cache.expert_of_slot.tolist() == [1 if admitted else 0]


@pytest.mark.parametrize("policy", POLICIES)
def test_padding_ids_are_neither_counted_nor_filled(policy: str) -> None:
    cache = ExpertCache(CacheSettings(policy), num_experts=4, slots=2, device="cpu")
    fills = [1, -1] if policy != "off" else [-1, -1]
    assert _step(cache, [[1, -1], [-1, -1]])[::4] == (fills, 1)
    assert cache.slot_of_expert.tolist().count(-1) == (3 if policy != "off" else 4)


def _state(cache: ExpertCache) -> list[torch.Tensor]:
    """Everything a step may change: assignment, scores, both decayed scales, the advantage, the LRU clock."""
    return [t.clone() for t in (cache.slot_of_expert, cache.expert_of_slot, cache._score, cache._scales,
                                cache._advantage, cache._clock)]


def _warm(policy: str, layers: int | None = None) -> ExpertCache:
    cache = ExpertCache(CacheSettings(policy, half_life_tokens=2.0), num_experts=6, slots=2, device="cpu",
                        layers=layers)
    for ids in ([[0, 1], [2, 1]], [[3, 4]], [[0, 5], [1, 2], [4, 3]]):
        cache.step(torch.tensor(ids if layers is None else [ids] * layers))
    return cache


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("tokens", [1, 8])
def test_an_all_padding_step_leaves_the_policy_as_it_was(policy: str, tokens: int) -> None:
    """A replayed dummy batch or an idle data-parallel engine's (every row padding, ids -1) reads nothing, so it
    must not age the decayed counts or advance the LRU clock either: the next real step decides as without it."""
    cache = _warm(policy)
    before = _state(cache)
    assert _step(cache, [[-1, -1]] * tokens)[3:] == (0, 0)
    assert all(torch.equal(a, b) for a, b in zip(before, _state(cache))), policy


@pytest.mark.parametrize("policy", POLICIES)
def test_padding_rows_age_nothing_beside_real_ones(policy: str) -> None:
    """A captured size's tail: 2 real tokens padded to 5 rows ages the policy as those 2 tokens alone (LRU stamps
    count real tokens only), here and in a following step that tells the policies' choices apart; on a layer axis
    too, where each layer's real tokens count for it."""
    alone, padded = _warm(policy), _warm(policy)
    assert _step(alone, [[5, 2], [0, 3]]) == _step(padded, [[5, 2], [-1, -1], [0, 3], [-1, -1], [-1, -1]])
    assert all(torch.allclose(a, b, rtol=1e-12, atol=0) for a, b in zip(_state(alone), _state(padded)))
    assert _step(alone, [[4, 1]]) == _step(padded, [[4, 1]])
    layered = _warm(policy, layers=2)
    layered.step(torch.tensor([[[5, 2], [0, 3], [-1, -1]], [[-1, -1], [-1, -1], [-1, -1]]]))
    one = _warm(policy)
    one.step(torch.tensor([[5, 2], [0, 3]]))
    assert torch.allclose(layered._clock[0], one._clock[0]) and torch.allclose(layered._scales[:, 0], one._scales[:, 0])
    assert torch.equal(layered._scales[:, 1], _warm(policy, layers=2)._scales[:, 1])  # layer 1: all padding


def test_off_counts_reads_and_never_fills() -> None:
    initial = torch.tensor([1, -1, 0, -1], dtype=torch.int32)
    cache = ExpertCache(CacheSettings("off"), num_experts=4, slots=2, device="cpu", initial=initial)
    assert _step(cache, [[0, 1], [2, 3], [1, 2]]) == ([-1, -1], [-1, -1], [-1, -1], 3, 3)
    assert cache.slot_of_expert.tolist() == initial.tolist()


def _reference_check(cache: ExpertCache, ids: torch.Tensor, before: list[int], pinned: set[int]) -> None:
    """The invariants of one step, in plain Python from the step's inputs and outputs."""
    step = cache.step(ids)
    read = ids.flatten().tolist()
    resident_before = {e for e, s in enumerate(before) if s >= 0}
    assert int(step.hits) == sum(e in resident_before for e in read)
    assert int(step.misses) == sum(e not in resident_before for e in read)
    fills = [(e, s, v) for e, s, v in zip(*(t.tolist() for t in (step.fill_expert, step.fill_slot, step.evicted)))
             if e >= 0]
    for expert, slot, evicted in fills:
        assert expert in read and expert not in resident_before, "filled an expert not read from host"
        assert evicted not in read, "evicted an expert selected in the same step"
        assert evicted not in pinned, "evicted a pinned expert"
        assert (before.index(slot) if slot in before else -1) == evicted, "the slot's occupant is not the evictee"
    assert all(e == -1 for e in step.fill_expert.tolist()[len(fills):]), "padding is not at the end"
    slot_of_expert, expert_of_slot = cache.slot_of_expert.tolist(), cache.expert_of_slot.tolist()
    resident = {e: s for e, s in enumerate(slot_of_expert) if s >= 0}
    assert len(resident) <= cache.slots
    assert all(expert_of_slot[s] == e for e, s in resident.items())
    assert sum(e >= 0 for e in expert_of_slot) == len(resident)
    assert pinned <= resident.keys()
    expected = {e: s for e, s in enumerate(before) if s >= 0 and e not in {v for _, _, v in fills}}
    expected.update({e: s for e, s, _ in fills})
    assert resident == expected


@pytest.mark.parametrize("policy", ["lru", "decayed-lfu"])
def test_slot_accounting_on_random_routing(policy: str) -> None:
    rng = random.Random(policy)
    for trial in range(12):
        experts = rng.randint(2, 12)
        slots = rng.randint(0, experts)
        pinned = set(rng.sample(range(experts), rng.randint(0, slots)))
        mask = torch.tensor([e in pinned for e in range(experts)])
        cache = ExpertCache(CacheSettings(policy, rng.choice([1.0, 3.0, 50.0])), experts, slots, "cpu", pinned=mask)
        for _ in range(25):
            k = rng.randint(1, experts)
            ids = torch.tensor([rng.sample(range(experts), k) for _ in range(rng.randint(1, 4))])
            _reference_check(cache, ids, cache.slot_of_expert.tolist(), pinned)


def test_output_shapes_depend_on_tokens_k_and_slots_only() -> None:
    cache = ExpertCache(CacheSettings(), num_experts=16, slots=5, device="cpu")
    for tokens, k in ((1, 2), (2, 2), (3, 2), (7, 4)):
        for ids in (torch.zeros(tokens, k, dtype=torch.int64), torch.randint(0, 16, (tokens, k))):
            step = cache.step(ids)
            assert [tuple(t.shape) for t in (step.fill_expert, step.fill_slot, step.evicted)] == [(min(tokens * k, 5),)] * 3
            assert step.hits.shape == step.misses.shape == ()
    batched = ExpertCache(CacheSettings(), num_experts=16, slots=5, device="cpu", layers=3)
    step = batched.step(torch.randint(0, 16, (3, 2, 4)))
    assert tuple(step.fill_slot.shape) == (3, 5) and tuple(step.hits.shape) == (3,)


@pytest.mark.parametrize("policy", POLICIES)
def test_two_caches_fed_the_same_ids_agree_and_digests_tell_them_apart(policy: str) -> None:
    one, two = (ExpertCache(CacheSettings(policy), 10, 4, "cpu") for _ in range(2))
    gen = torch.Generator().manual_seed(1)
    for _ in range(30):
        ids = torch.stack([torch.randperm(10, generator=gen)[:3] for _ in range(2)])
        a, b = one.step(ids), two.step(ids)
        assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("fill_expert", "fill_slot", "evicted", "hits"))
    assert torch.equal(one.slot_of_expert, two.slot_of_expert) and torch.equal(one.state_digest(), two.state_digest())
    two.step(torch.tensor([[0, 1, 2]]))
    one.step(torch.tensor([[7, 8, 9]]))
    assert not torch.equal(one.state_digest(), two.state_digest())


def test_a_layer_axis_is_independent_layers() -> None:
    layers, gen = 3, torch.Generator().manual_seed(2)
    batched = ExpertCache(CacheSettings(), 8, 3, "cpu", layers=layers)
    single = [ExpertCache(CacheSettings(), 8, 3, "cpu") for _ in range(layers)]
    for _ in range(20):
        ids = torch.stack([torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(2)])
                           for _ in range(layers)])
        step = batched.step(ids)
        for layer, cache in enumerate(single):
            assert torch.equal(cache.step(ids[layer]).fill_expert, step.fill_expert[layer])
    assert torch.equal(batched.slot_of_expert, torch.stack([c.slot_of_expert for c in single]))


@pytest.mark.parametrize("policy", POLICIES)
def test_step_makes_no_host_synchronisation(policy: str) -> None:
    """The meta proof (and the op-name net on real tensors): a step reads no device data on the host."""
    cache = ExpertCache(CacheSettings(policy), 64, 16, META, pinned=torch.arange(64) < 4)
    step = cache.step(torch.empty(5, 6, dtype=torch.int64, device=META))
    assert step.fill_slot.device == META and tuple(step.fill_slot.shape) == (16,)
    assert cache.state_digest().device == META
    real, ids = ExpertCache(CacheSettings(policy), 64, 16, "cpu"), torch.randint(0, 64, (5, 6))
    with NoHostSync():
        real.step(ids)


@pytest.mark.parametrize("pattern", sorted(BAD_PATTERNS))
def test_the_meta_proof_catches_a_planted_sync(pattern: str, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = ExpertCache(CacheSettings(), 64, 16, META)
    monkeypatch.setattr(cache, "_apply", planted(cache._apply, BAD_PATTERNS[pattern]))
    with pytest.raises(HOST_SYNC_ON_META, match="(?i)meta"):
        cache.step(torch.empty(5, 6, dtype=torch.int64, device=META))


def test_settings_parse_and_refuse_by_key() -> None:
    assert parse_cache_settings({}) == CacheSettings()
    assert parse_cache_settings({"policy": "lru", "half_life_tokens": 3}) == CacheSettings("lru", 3.0)
    with pytest.raises(CacheSettingsError, match=r"dynamic\.policy: 'lfu' is not one of"):
        parse_cache_settings({"policy": "lfu"})
    with pytest.raises(CacheSettingsError, match=r"dynamic\.half_life_tokens"):
        parse_cache_settings({"half_life_tokens": -1})
    with pytest.raises(CacheSettingsError, match=r"dynamic\.halflife: unknown option"):
        parse_cache_settings({"halflife": 4})
    with pytest.raises(CacheSettingsError, match="expected an object"):
        parse_cache_settings("lru")


def test_bad_starting_state_is_refused() -> None:
    with pytest.raises(ValueError, match="slots must be in"):
        ExpertCache(CacheSettings(), 4, 5, "cpu")
    with pytest.raises(ValueError, match="two experts"):
        ExpertCache(CacheSettings(), 4, 2, "cpu", initial=torch.tensor([0, 0, -1, -1]))
    with pytest.raises(ValueError, match="pinned experts need slots"):
        ExpertCache(CacheSettings(), 4, 1, "cpu", pinned=torch.tensor([True, True, False, False]))
    with pytest.raises(ValueError, match=r"initial must have shape \(4,\)"):
        ExpertCache(CacheSettings(), 4, 1, "cpu", initial=torch.tensor([0, -1]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_step_captured_in_a_cuda_graph_matches_eager() -> None:
    eager, captured = (ExpertCache(CacheSettings(), 64, 16, "cuda") for _ in range(2))
    ids = torch.zeros(4, 6, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        warm = ExpertCache(CacheSettings(), 64, 16, "cuda")
        warm.step(ids)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = captured.step(ids)
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        ids.copy_(torch.stack([torch.randperm(64, generator=gen)[:6] for _ in range(4)]))
        graph.replay()
        want = eager.step(ids)
        assert torch.equal(out.fill_expert, want.fill_expert) and torch.equal(out.hits, want.hits)
    assert torch.equal(captured.slot_of_expert, eager.slot_of_expert)
