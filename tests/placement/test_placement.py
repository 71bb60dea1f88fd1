"""Placement layer (vllm_expert_offload.placement): planner optimality and limits, plan files, ledger, routing stats.

Pure numpy; the real-data tests read ../shared/data/routing in place and skip when it is absent; each has a twin on
routing data generated in code (tests/support/routing_fixtures.py) that runs on a bare clone.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from vllm_expert_offload.placement import (
    DecodeCostModel,
    Ledger,
    PlacementError,
    ModelIdentity,
    RoutingCounts,
    RoutingTrace,
    SegmentedCounts,
    expected_layer_bytes,
    load_plan,
    load_routing_dataset,
    plan_placement,
    save_plan,
)
from vllm_expert_offload.placement import planner as planner_module

from support.paths import SHARED
from support.routing_fixtures import synthetic_routing, write_every_format

ROUTING = SHARED / "data" / "routing"
needs_routing = pytest.mark.skipif(
    not ROUTING.is_dir(), reason=f"shared routing data not present at {ROUTING}; the generated-data twins run without it"
)


def random_instance(rng: np.random.Generator, layers: int, experts: int, mixed: bool):
    base = int(rng.integers(1, 1000))
    sizes = rng.integers(1, 8, size=(layers, experts)) * base if mixed else np.full((layers, experts), base)
    counts = rng.zipf(1.5, size=(layers, experts)).astype(float) * (rng.random((layers, experts)) > 0.2)
    budget = int(rng.integers(0, sizes.sum() + 1))
    return sizes, counts, budget


def host_traffic(plan: np.ndarray, sizes: np.ndarray, counts: np.ndarray) -> float:
    return float((counts * sizes)[~plan].sum())


def brute_force_best(sizes: np.ndarray, counts: np.ndarray, budget: int) -> float:
    """Largest GPU-kept traffic over all 2^n subsets (n <= 14)."""
    n = sizes.size
    subsets = (np.arange(1 << n)[:, None] >> np.arange(n)[None, :]) & 1
    used = subsets @ sizes.ravel()
    kept = subsets @ (counts * sizes).ravel()
    return float(kept[used <= budget].max())


# --- planner ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mixed", [False, True])
def test_budget_respected_and_no_room_left(mixed):
    cost = DecodeCostModel(top_k=2, dense_bytes_per_layer=5000.0)
    for seed in range(150):
        rng = np.random.default_rng(seed)
        sizes, counts, budget = random_instance(rng, int(rng.integers(1, 6)), int(rng.integers(1, 12)), mixed)
        for plan in (
            plan_placement(sizes, budget),
            plan_placement(sizes, budget, counts),
            plan_placement(sizes, budget, counts, balance_layers=cost),
        ):
            assert plan.dtype == bool and plan.shape == sizes.shape
            used = int(sizes[plan].sum())
            assert used <= budget, seed
            assert (~plan).sum() == 0 or sizes[~plan].min() > budget - used, f"seed {seed}: a host expert still fits"


@pytest.mark.parametrize(("sizes", "budget", "counts", "balance", "want"), [
    # The fix-up: after the 20-byte expert, the 10-byte one fills the leftover 10 bytes exactly.
    ([[10, 20]], 30, [[0, 0]], False, [[True, True]]),
    ([[10, 20]], 30, None, False, [[True, True]]),
    # The exact solver: taking the hot 20-byte expert uses the budget to the byte (two cold 10-byte ones would fit
    # as well, and keep less traffic).
    ([[10, 10, 20]], 20, [[1, 1, 10]], False, [[False, False, True]]),
    # Every expert fits exactly.
    ([[10, 20], [30, 40]], 100, [[1, 2], [3, 4]], False, [[True, True], [True, True]]),
    # The balancing greedy: the 10-byte expert fits the 10 bytes the hot one leaves; skipping it would let the
    # cold 5-byte one in instead, and the fix-up could not take it back.
    ([[10, 20, 5]], 30, [[3, 5, 1]], True, [[True, True, False]]),
])
def test_an_expert_that_fits_the_budget_exactly_is_placed_on_the_gpu(sizes, budget, counts, balance, want):
    cost = DecodeCostModel(top_k=1) if balance else None
    assert plan_placement(sizes, budget, counts, balance_layers=cost).tolist() == want


def test_exact_against_brute_force_mixed_sizes():
    for seed in range(120):
        rng = np.random.default_rng(1000 + seed)
        sizes, counts, budget = random_instance(rng, 2, 6, mixed=True)
        plan = plan_placement(sizes, budget, counts)
        kept = float((counts * sizes)[plan].sum())
        assert kept == pytest.approx(brute_force_best(sizes, counts, budget), rel=1e-12, abs=1e-9), seed


def test_fallback_misses_optimum_by_at_most_one_expert(monkeypatch):
    monkeypatch.setattr(planner_module, "FRONTIER_LIMIT", 1)  # force density greedy on every mixed instance
    for seed in range(120):
        rng = np.random.default_rng(2000 + seed)
        sizes, counts, budget = random_instance(rng, 2, 6, mixed=True)
        plan = plan_placement(sizes, budget, counts)
        assert int(sizes[plan].sum()) <= budget
        gap = brute_force_best(sizes, counts, budget) - float((counts * sizes)[plan].sum())
        assert gap <= float((counts * sizes).max()) + 1e-9, seed


def test_counts_never_worse_than_countless_plan():
    for seed in range(100):
        rng = np.random.default_rng(3000 + seed)
        sizes, counts, budget = random_instance(rng, 4, 16, mixed=bool(seed % 2))
        with_counts = plan_placement(sizes, budget, counts)
        without = plan_placement(sizes, budget)
        assert host_traffic(with_counts, sizes, counts) <= host_traffic(without, sizes, counts) + 1e-9


def test_countless_plan_spreads_low_ids_evenly():
    plan = plan_placement(np.full((4, 8), 100), 1000)
    assert plan.sum(axis=1).tolist() == [3, 3, 2, 2]
    for row in plan:
        assert row.tolist() == [True] * row.sum() + [False] * (8 - row.sum())


def test_deterministic_and_input_type_agnostic():
    rng = np.random.default_rng(7)
    sizes, counts, budget = random_instance(rng, 5, 10, mixed=True)
    first = plan_placement(sizes, budget, counts)
    assert np.array_equal(first, plan_placement(sizes.tolist(), budget, counts.tolist()))
    assert np.array_equal(first, plan_placement(sizes, float(budget), counts))
    assert np.array_equal(first, plan_placement(sizes, budget + 0.9, counts))  # fractional budgets round down


def test_balancing_moves_budget_to_the_layer_that_stalls():
    # Layer 0: two equally hot experts; layer 1: one hot one. GPU work (dense) hides ~half a layer's host reads.
    sizes = np.full((2, 4), 1000)
    counts = np.array([[50, 50, 0, 0], [45, 30, 25, 0]], dtype=float)
    cost = DecodeCostModel(top_k=1, link_bytes_per_s=1.0, gpu_bytes_per_s=100.0, dense_bytes_per_layer=50_000.0)
    knapsack = plan_placement(sizes, 2000, counts)
    balanced = plan_placement(sizes, 2000, counts, balance_layers=cost)
    assert np.flatnonzero(knapsack.ravel()).tolist() == [0, 1]
    assert np.flatnonzero(balanced.ravel()).tolist() == [0, 4]

    def seconds(plan: np.ndarray) -> float:
        gpu, host = expected_layer_bytes(~plan, sizes, cost.selections_per_token(counts))
        return float(cost.layer_seconds(gpu, host).sum())

    assert seconds(balanced) < seconds(knapsack)


@pytest.mark.parametrize(
    ("args", "kwargs", "named"),
    [
        (([[1, 2], [3]], 10), {}, "expert_bytes"),
        (([[1, -2], [3, 4]], 10), {}, "expert_bytes"),
        (([[1.5, 2], [3, 4]], 10), {}, "expert_bytes"),
        (([[1, 2], [3, 4]], -1), {}, "gpu_budget_bytes"),
        (([[1, 2], [3, 4]], float("nan")), {}, "gpu_budget_bytes"),
        (([[1, 2], [3, 4]], 10, [[1, 2, 3], [4, 5, 6]]), {}, "routing_counts"),
        (([[1, 2], [3, 4]], 10, [[1, -2], [3, 4]]), {}, "routing_counts"),
        (([[1, 2], [3, 4]], 10), {"balance_layers": DecodeCostModel(top_k=1)}, "balance_layers"),
    ],
)
def test_refuses_bad_input_naming_the_argument(args, kwargs, named):
    with pytest.raises(ValueError, match=named):
        plan_placement(*args, **kwargs)


# --- plan files ------------------------------------------------------------------------------------------------

SIZES = np.full((3, 8), 4096 * 3)


def identity(**changes) -> ModelIdentity:
    sizes = changes.pop("expert_bytes", SIZES)
    fields = {"architecture": "DeepseekV2ForCausalLM", "num_layers": 4, "moe_layers": [1, 2, 3], "tp_size": 2}
    return ModelIdentity.from_expert_bytes(expert_bytes=sizes, **(fields | changes))


def test_plan_file_round_trip_and_hand_edit(tmp_path):
    plan = plan_placement(SIZES, SIZES.sum() // 2, np.arange(24).reshape(3, 8))
    path = tmp_path / "plan.json"
    save_plan(path, plan, identity(), budget_bytes=int(SIZES.sum() // 2))
    assert np.array_equal(load_plan(path, identity()), plan)
    doc = json.loads(path.read_text())
    assert doc["format"] == "vllm-expert-offload/plan" and doc["version"] == 1
    assert sorted(doc["gpu_experts"]) == ["1", "2", "3"]
    assert '    "2": [' in path.read_text()  # one layer per line
    doc["gpu_experts"]["1"] = [0]
    path.write_text(json.dumps(doc))
    edited = load_plan(path, identity())
    assert edited[0].tolist() == [True] + [False] * 7 and np.array_equal(edited[1:], plan[1:])


@pytest.mark.parametrize(
    ("running", "field"),
    [
        (identity(architecture="Qwen3MoeForCausalLM"), "model.architecture"),
        (identity(tp_size=1), "model.tp_size"),
        (identity(expert_bytes=SIZES + 4096), "model.expert_bytes_sha256"),
        (identity(expert_bytes=np.full((3, 9), 4096)), "model.num_experts"),
        (identity(moe_layers=[0, 1, 2]), "model.moe_layers"),
    ],
)
def test_plan_for_another_model_is_refused_naming_the_field(tmp_path, running, field):
    path = tmp_path / "plan.json"
    save_plan(path, np.zeros((3, 8), dtype=bool), identity())
    with pytest.raises(ValueError, match=field):
        load_plan(path, running)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(version=2), "'version' 2 is not supported"),
        (lambda d: d.update(format="something/else"), "'format'"),
        (lambda d: d["gpu_experts"].update({"1": [0, 8]}), r"expert ids \[8\] outside \[0, 8\)"),
        (lambda d: d["gpu_experts"].update({"2": [3, 3]}), r"expert ids \[3\] more than once"),
        (lambda d: d["gpu_experts"].pop("3"), r"missing: \['3'\]"),
        (lambda d: d["gpu_experts"].update({"1": [True]}), "integer expert ids"),
    ],
)
def test_malformed_plan_file_is_refused(tmp_path, edit, message):
    path = tmp_path / "plan.json"
    save_plan(path, np.zeros((3, 8), dtype=bool), identity())
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=message):
        load_plan(path, identity())


# --- ledger ----------------------------------------------------------------------------------------------------


def ledger_for(plan: np.ndarray, sizes: np.ndarray) -> Ledger:
    return Ledger.from_plan(
        plan, sizes, non_expert_bytes=10_000, kv_cache_bytes=20_000, workspace_bytes=3_000, headroom_bytes=1_000
    )


def test_ledger_rows_sum_to_totals_and_alignment_is_counted():
    sizes = np.full((2, 4), 5000)  # host records pad to 8192: 3192 bytes each
    plan = np.array([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=bool)
    ledger = ledger_for(plan, sizes)
    rows = ledger.rows()
    assert sum(r.nbytes for r in rows if r.tier == "device") == ledger.device_bytes == 34_000 + 3 * 5000
    assert sum(r.nbytes for r in rows if r.tier == "host") == ledger.host_bytes == 5 * 8192
    assert ledger.host_alignment_bytes == 5 * 3192 and (ledger.gpu_experts, ledger.host_experts) == (3, 5)
    table = ledger.format_table(100_000, 0.1)
    assert "GPU-tier experts" in table and "49,000" in table and "90,000" in table and "free" in table
    ledger.check_fits(100_000, 0.1)


def test_ledger_check_fits_says_how_much_to_move():
    ledger = ledger_for(np.ones((2, 4), dtype=bool), np.full((2, 4), 5000))  # device 74,000 bytes
    with pytest.raises(ValueError) as info:
        ledger.check_fits(60_000, margin_fraction=0.0)
    text = str(info.value)
    assert "move at least 14,000 bytes" in text and "at least 3 of the 8 GPU-tier experts" in text and "OVER" in text
    with pytest.raises(ValueError, match="even with every expert on host"):
        ledger.check_fits(30_000, margin_fraction=0.0)


# --- routing statistics ----------------------------------------------------------------------------------------


def test_counts_add_and_merge_equal_bincount(tmp_path):
    rng = np.random.default_rng(11)
    batches = {layer: rng.integers(0, 16, size=(2, 37, 4)) for layer in (1, 3)}  # [ranks, tokens, k]
    ranks = [RoutingCounts.zeros((1, 3), 16), RoutingCounts.zeros((1, 3), 16)]
    for layer, ids in batches.items():
        for rank, part in enumerate(ranks):
            part.add(layer, ids[rank])
    merged = RoutingCounts.merge(ranks)
    reference = np.stack([np.bincount(batches[layer].ravel(), minlength=16) for layer in (1, 3)])
    assert np.array_equal(merged.counts, reference) and merged.counts.dtype == np.int64
    with pytest.raises(ValueError, match="topk_ids"):
        ranks[0].add(1, np.array([16]))
    with pytest.raises(ValueError, match="layer 2"):
        ranks[0].add(2, np.array([0]))


def test_counts_file_round_trip_checks_the_model(tmp_path):
    model = identity(expert_bytes=np.full((3, 8), 100))
    counts = RoutingCounts(np.arange(24).reshape(3, 8), (1, 2, 3), model)
    path = tmp_path / "counts.json"
    counts.save(path)
    loaded = RoutingCounts.load(path, expected=identity(tp_size=1))  # TP size and bytes do not matter for routing
    assert np.array_equal(loaded.counts, counts.counts) and loaded.model == model
    with pytest.raises(ValueError, match="model.architecture"):
        RoutingCounts.load(path, expected=identity(architecture="Other"))


def test_trace_segments_count_like_bincount():
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 8, size=(30, 3, 2))
    trace = RoutingTrace(ids, np.array([0, 10, 30]), ("a", "b"), (0, 1, 2), 8)
    per_segment = trace.segmented()
    for s, (lo, hi) in enumerate([(0, 10), (10, 30)]):
        expected = np.stack([np.bincount(ids[lo:hi, layer].ravel(), minlength=8) for layer in range(3)])
        assert np.array_equal(per_segment.counts[s], expected)
    assert np.array_equal(trace.select([1]).total().counts, per_segment.total([1]).counts)
    with pytest.raises(ValueError, match="segment_offsets"):
        RoutingTrace(ids, np.array([0, 10, 29]), ("a", "b"), (0, 1, 2), 8)
    with pytest.raises(ValueError, match="expert_ids"):
        RoutingTrace(ids, np.array([0, 30]), ("a",), (0, 1, 2), 7)


# --- real routing data -----------------------------------------------------------------------------------------


@needs_routing
def test_reads_every_shared_routing_format():
    def one(rel: str):
        (data,) = load_routing_dataset(ROUTING / rel).values()
        return data

    olmoe = one("OLMoE/scripts/routing_output/olmoe/expert_counts/c4.npz")  # npz counts
    assert isinstance(olmoe, RoutingCounts) and olmoe.counts.shape == (3, 64)
    assert len(set(olmoe.counts.sum(axis=1))) == 1 and olmoe.counts.sum(axis=1)[0] % 8 == 0
    qwen = one("moe-interp/data-ext/pt/arxiv_expert_data_qwen.npz")  # npz float counts with layer ids
    assert qwen.counts.shape == (24, 60) and qwen.moe_layers[0] == 1
    specmoe = one("specMoE/routing_data/expert_statistics_3d.json")  # json counts
    assert specmoe.moe_layers == (1, 3, 5, 7, 9, 11) and set(specmoe.counts.sum(axis=1)) == {206_866}
    frequencies = load_routing_dataset(
        next((ROUTING / "qwen-hebrew-finetuning").rglob("*arc*avg_activation.csv"))
    )  # csv frequencies
    assert sorted(k.rsplit("/", 1)[1] for k in frequencies) == ["English", "Hebrew"]
    for data in frequencies.values():
        assert data.counts.shape == (48, 128) and np.allclose(data.counts.sum(axis=1), 8e6, rtol=1e-3)
    mixtral = one("speculative-moe/routing_data_collected/gsm8k_2_routing.jsonl")  # jsonl trace
    assert mixtral.expert_ids.shape[1:] == (32, 2) and mixtral.segment_names == ("gsm8k/0", "gsm8k/1")

    beyond = ROUTING / "moe-beyond"
    trace = one(beyond / "derived_deepseek_v2_lite_chat_puffin_prompts1001-2000_topk.npz")  # npz trace
    per_prompt = one(beyond / "derived_deepseek_v2_lite_chat_puffin_prompts0001-2000_per_prompt_counts.npz")
    csv_trace = one(beyond / "expert_activation_scripts/training_data_eamc/prompt_1001_data.csv")  # csv trace
    assert isinstance(per_prompt, SegmentedCounts) and per_prompt.counts.shape == (1999, 26, 64)
    first = trace.select([trace.segment_names.index("1001")])
    assert np.array_equal(np.sort(csv_trace.expert_ids, axis=2), first.expert_ids)  # source order vs sorted ids
    assert np.array_equal(first.total().counts, per_prompt.total([per_prompt.segment_names.index("1001")]).counts)


@needs_routing
def test_directory_load_skips_non_routing_files():
    found = load_routing_dataset(ROUTING / "OLMoE")
    assert found and all(isinstance(v, RoutingCounts) for v in found.values())
    assert not any("crosslayer" in key for key in found)  # pair counts are not per-expert counts


# --- generated routing data (a bare clone) ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    data = synthetic_routing(seed=12, moe_layers=(1, 3, 5, 7, 9, 11))
    return data, write_every_format(tmp_path_factory.mktemp("routing"), data)


def test_reads_every_routing_format_from_generated_data(synthetic):
    """The same readers as test_reads_every_shared_routing_format, checked against the trace they were written from."""
    data, files = synthetic
    trace, counts = data.trace, data.trace.total().counts

    def one(kind: str, **kwargs):
        (found,) = load_routing_dataset(files[kind], **kwargs).values()
        return found

    for kind in ("npz counts", "npz float counts", "json counts"):
        loaded = one(kind)
        assert isinstance(loaded, RoutingCounts) and np.array_equal(loaded.counts, counts), kind
    assert one("npz float counts").moe_layers == one("json counts").moe_layers == trace.moe_layers
    assert one("npz counts").moe_layers == tuple(range(6))  # no layer ids stored: rows numbered
    npz_trace = one("npz trace", num_experts=trace.num_experts)
    assert np.array_equal(npz_trace.expert_ids, trace.expert_ids)
    assert np.array_equal(npz_trace.segment_offsets, trace.segment_offsets)
    assert (npz_trace.segment_names, npz_trace.moe_layers) == (trace.segment_names, trace.moe_layers)
    per_prompt = one("npz segmented")
    assert isinstance(per_prompt, SegmentedCounts) and per_prompt.segment_names == trace.segment_names
    assert np.array_equal(per_prompt.counts, trace.segmented().counts)
    first = trace.select([0])
    csv_trace = one("csv trace", num_experts=trace.num_experts)
    assert np.array_equal(csv_trace.expert_ids, first.expert_ids) and csv_trace.moe_layers == trace.moe_layers
    assert np.array_equal(csv_trace.total().counts, per_prompt.total([0]).counts)
    frequencies = load_routing_dataset(files["csv frequencies"])
    assert sorted(k.rsplit("/", 1)[1] for k in frequencies) == ["English", "Hebrew"]
    scale = 1e6 / len(trace.expert_ids)  # fractions of tokens, read back per million tokens
    english = next(v for k, v in frequencies.items() if k.endswith("English"))
    assert np.allclose(english.counts, counts * scale, atol=1) and english.moe_layers == trace.moe_layers
    jsonl = one("jsonl trace", num_experts=trace.num_experts)
    assert jsonl.segment_names == tuple(f"gsm8k/{name}" for name in trace.segment_names)
    kept = np.concatenate([trace.expert_ids[a:b - 1] for a, b in zip(trace.segment_offsets, trace.segment_offsets[1:])])
    assert np.array_equal(jsonl.expert_ids, kept)  # each problem's last token lacked a layer: dropped


def test_directory_load_skips_non_routing_generated_files(synthetic):
    data, files = synthetic
    found = load_routing_dataset(files["npz counts"].parent.parent, num_experts=data.trace.num_experts)
    assert len(found) == 9  # 8 formats, the frequency file holding two languages
    assert not any("crosslayer" in key or "README" in key for key in found)


def test_generated_routing_is_skewed_and_planning_on_it_pays():
    """A plan from one half of the prompts keeps more of the other half's expert reads on the GPU than a
    countless plan of the same budget, and than the GPU's share of the bytes: the property planning rests on."""
    trace = synthetic_routing(seed=3, layers=8, experts=64, top_k=4, segment_tokens=(200,) * 8).trace
    segmented = trace.segmented()
    seen, unseen = segmented.total(slice(0, 4)).counts, segmented.total(slice(4, 8)).counts
    top8 = np.sort(unseen, axis=1)[:, ::-1][:, :8].sum() / unseen.sum()
    assert top8 > 0.4  # an eighth of the experts carry over 40 % of the selections: Zipf-like, not uniform
    sizes = np.full(unseen.shape, 1000)
    budget = sizes.sum() // 4
    informed, countless = plan_placement(sizes, budget, seen), plan_placement(sizes, budget)
    assert (sizes * informed).sum() <= budget and informed.sum() == countless.sum() == unseen.size // 4

    def gpu_share(plan: np.ndarray) -> float:
        return float(unseen[plan].sum() / unseen.sum())

    assert gpu_share(informed) > 0.55 and gpu_share(countless) < 0.35  # a quarter of the bytes: ~0.25 blind
    assert np.array_equal(synthetic_routing(seed=3, layers=8, experts=64, segment_tokens=(200,) * 8).trace.expert_ids,
                          trace.expert_ids)  # fixed seed: the same data on every machine


def test_ledger_host_rows_are_node_totals_over_three_ranks_and_device_rows_one_ranks():
    """Each of 3 tensor-parallel ranks pins its own share of every host-tier expert: the node holds 3 times one
    rank's host bytes (experts and their alignment); the node's other pinned memory is counted once, and the
    device rows stay one GPU's. (No fixture builds a ledger with more than one rank; 3 is no power of two.)"""
    sizes = np.full((2, 4), 5000)  # one rank's share of each expert; host records pad to 8192
    plan = np.array([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=bool)
    one = ledger_for(plan, sizes)
    three = Ledger.from_plan(plan, sizes, non_expert_bytes=10_000, kv_cache_bytes=20_000, workspace_bytes=3_000,
                             headroom_bytes=1_000, ranks=3, host_bytes={"engram table": 777})
    host = {r.item: r.nbytes for r in three.rows() if r.tier == "host"}
    assert host["host-tier experts"] == 3 * 5 * 5000 and host["arena alignment"] == 3 * 5 * 3192
    assert host["engram table"] == 777 and three.host_bytes == 3 * 5 * 8192 + 777
    assert three.device_bytes == one.device_bytes and three.host_experts == one.host_experts == 5
    with pytest.raises(PlacementError, match="ranks must be a positive integer"):
        Ledger.from_plan(plan, sizes, non_expert_bytes=0, kv_cache_bytes=0, ranks=0)
