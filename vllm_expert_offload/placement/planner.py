"""Choose, before any weight is loaded, which routed experts live in GPU memory and which in the pinned host arena.

Objective. A host-tier expert costs PCIe traffic every time a token routes to it, so with routing counts c[l, e] and
byte sizes b[l, e] the planner minimizes the expected host-read bytes  sum over host experts of c * b  subject to
sum over GPU experts of b <= budget. Equivalently it maximizes the traffic kept on the GPU: a 0/1 knapsack with value
c * b and weight b, hence value density c.

Exact method. Experts of equal size are interchangeable except for their counts, so an optimal plan takes, for each
distinct size s, the n_s hottest experts of that size (exchange argument). What remains is choosing the n_s: the
sizes are solved one after another keeping only the Pareto frontier of (bytes used, traffic saved) states
(Nemhauser-Ullmann), and the most common size goes last, filled with as many of its hottest experts as fit (saved
traffic never decreases with n, so that is optimal for each frontier state). With one size -- all experts of a model
at one bitrate, the usual case -- this reduces to sorting by count, and with two sizes to a scan over n_1. It is exact
for any mix of sizes while the frontier stays under FRONTIER_LIMIT candidates.

Fallback. Above that limit (many distinct sizes, each with many experts) the planner takes experts by count density
(hottest first, skipping ones that no longer fit). Its traffic saved is at least the LP-relaxation optimum minus the
value c * b of the first expert that did not fit, so it misses the optimum by at most one expert's traffic.

Fix-up. Whatever budget is left (zero-count experts, size granularity) is filled hottest-first, so the GPU tier is
never left emptier than the budget allows.

Layer balancing (`balance_layers=DecodeCostModel(...)`, see cost.py): minimizes the model's per-token time
sum_l max(t_gpu(l), t_host(l)) instead of total host bytes, by a greedy that always moves the expert with the largest
time saved per byte, then the fix-up on what is left. It is a heuristic. Measured against the plain knapsack on 10
routing data sets x 3 budgets (benchmarks/bench_placement.py, docs/benchmarks.md "Expert placement"): PCIe 4.0 x16
+0.02 % mean estimated time (no run more than 1 % faster), PCIe 5.0 x16 +0.02 %, a 450 GB/s C2C link -0.6 % mean
(-6.1 % best, 5 of 30 runs more than 1 % faster). Over PCIe one host expert read outlasts a layer's whole GPU work, so
there is nothing to hide host reads behind and total host bytes is what matters; the default is therefore off.

Without counts every expert is assumed equally hot: the same knapsack with unit counts, ties broken by (expert id,
layer). With equal sizes that gives every layer the same number of GPU experts (+-1, the extra ones to the first
layers) -- equal per-layer host traffic, which is what spreading is for -- and keeps the lowest ids on the GPU, so the
host tier of each layer is a contiguous tail like exllamav3's --moe_cpu_split and the plan is easy to read. Which ids
is otherwise arbitrary: without statistics no expert is expected to be hotter than another.
"""

from __future__ import annotations

import heapq

import numpy as np

from ._validate import as_byte_count, as_matrix
from .cost import DecodeCostModel
from .errors import PlacementError

FRONTIER_LIMIT = 1 << 22  # candidate (state, n) pairs per merge step of the exact solver


def plan_placement(
    expert_bytes: object,
    gpu_budget_bytes: int | float,
    routing_counts: object | None = None,
    *,
    balance_layers: DecodeCostModel | None = None,
) -> np.ndarray:
    """GPU-tier mask [layers, experts] (True = GPU) whose bytes never exceed `gpu_budget_bytes`.

    `expert_bytes` and `routing_counts` are [layers][experts] (lists or arrays); counts may be fractional (frequencies).
    A fractional budget (e.g. 0.1 * GiB) is rounded down.
    `balance_layers` switches to the layer-balancing heuristic for that cost model; it needs `routing_counts`.
    Deterministic: the same inputs always give the same plan.
    """
    sizes = as_matrix("expert_bytes", expert_bytes, integer=True)
    budget = as_byte_count("gpu_budget_bytes", gpu_budget_bytes, round_down=True)
    if routing_counts is None:
        if balance_layers is not None:
            raise PlacementError("balance_layers needs routing_counts: balancing weighs each layer's expected host reads")
        counts = np.ones(sizes.shape)
    else:
        counts = as_matrix("routing_counts", routing_counts, integer=False)
        if counts.shape != sizes.shape:
            raise PlacementError(f"routing_counts has shape {counts.shape} but expert_bytes has {sizes.shape}")
    key = _tie_key(sizes.shape)
    if balance_layers is None:
        return _knapsack(sizes.ravel(), counts.ravel(), key, budget).reshape(sizes.shape)
    return _balanced(sizes, counts, key, budget, balance_layers)


def _tie_key(shape: tuple[int, int]) -> np.ndarray:
    """Rank of each flat index in (expert id, layer) order: equal candidates alternate over layers, low ids first."""
    layers, experts = shape
    flat = np.arange(layers * experts)
    return (flat % experts) * layers + flat // experts


def _hottest_first(counts: np.ndarray, key: np.ndarray, items: np.ndarray) -> np.ndarray:
    return items[np.lexsort((key[items], -counts[items]))]


def _knapsack(sizes: np.ndarray, counts: np.ndarray, key: np.ndarray, budget: int) -> np.ndarray:
    """Flat GPU mask maximizing sum(counts * sizes) over chosen items with sum(sizes) <= budget (module docstring)."""
    if sizes.size == 0:
        return np.zeros(0, dtype=bool)
    groups = [_hottest_first(counts, key, np.flatnonzero(sizes == s)) for s in np.unique(sizes)]
    groups.sort(key=len)
    taken = _counts_per_size(groups, sizes, counts, budget)
    chosen = np.zeros(sizes.size, dtype=bool)
    if taken is not None:
        for group, n in zip(groups, taken):
            chosen[group[:n]] = True
    return _fill(chosen, sizes, counts, key, budget)


def _counts_per_size(
    groups: list[np.ndarray], sizes: np.ndarray, counts: np.ndarray, budget: int
) -> list[int] | None:
    """How many of each size group's hottest items to take; None when the frontier would exceed FRONTIER_LIMIT."""
    used = np.zeros(1, dtype=np.int64)
    saved = np.zeros(1)
    steps: list[np.ndarray] = []
    for group in groups[:-1]:
        options = len(group) + 1
        if used.size * options > FRONTIER_LIMIT:
            return None
        size = int(sizes[group[0]])
        gain = size * np.concatenate(([0.0], np.cumsum(counts[group])))
        cand_used = (used[:, None] + size * np.arange(options)[None, :]).ravel()
        cand_saved = (saved[:, None] + gain[None, :]).ravel()
        fits = np.flatnonzero(cand_used <= budget)
        order = fits[np.lexsort((-cand_saved[fits], cand_used[fits]))]
        best_so_far = np.maximum.accumulate(cand_saved[order])
        pareto = order[np.concatenate(([True], cand_saved[order][1:] > best_so_far[:-1]))]
        steps.append(pareto)
        used, saved = cand_used[pareto], cand_saved[pareto]
    last = groups[-1]
    size = int(sizes[last[0]])
    room = len(last) if size == 0 else np.minimum(len(last), (budget - used) // size)
    gain = size * np.concatenate(([0.0], np.cumsum(counts[last])))
    room = np.broadcast_to(room, used.shape)
    state = int(np.argmax(saved + gain[room]))
    taken = [int(room[state])]
    for group, pareto in zip(reversed(groups[:-1]), reversed(steps)):
        state, n = divmod(int(pareto[state]), len(group) + 1)
        taken.append(n)
    return taken[::-1]


def _fill(chosen: np.ndarray, sizes: np.ndarray, counts: np.ndarray, key: np.ndarray, budget: int) -> np.ndarray:
    """Add host items hottest-first while they fit; from an empty mask this is the density-greedy fallback."""
    free = budget - int(sizes[chosen].sum())
    for item in _hottest_first(counts, key, np.flatnonzero(~chosen)):
        if sizes[item] <= free:
            chosen[item] = True
            free -= int(sizes[item])
    return chosen


def _balanced(
    sizes: np.ndarray, counts: np.ndarray, key: np.ndarray, budget: int, cost: DecodeCostModel
) -> np.ndarray:
    """Greedy on sum_l t(l): repeatedly move the expert saving the most time per byte, then fix up the rest."""
    per_token = cost.selections_per_token(counts)
    traffic = per_token * sizes
    gpu = [0.0] * sizes.shape[0]  # Python floats: this loop runs once per expert
    host = traffic.sum(axis=1).tolist()
    order = np.argsort(-per_token, axis=1, kind="stable")  # per layer, hottest first, ties by id
    position = np.zeros(sizes.shape[0], dtype=np.int64)
    chosen = np.zeros(sizes.shape, dtype=bool)
    free = budget

    def entry(layer: int) -> tuple[float, int] | None:
        if position[layer] == sizes.shape[1]:
            return None
        expert = order[layer, position[layer]]
        moved = float(traffic[layer, expert])
        before = cost.layer_seconds(gpu[layer], host[layer])
        saved = float(before - cost.layer_seconds(gpu[layer] + moved, host[layer] - moved))
        nbytes = int(sizes[layer, expert])
        return (-(saved / nbytes) if nbytes else -np.inf, layer)

    heap = [e for e in map(entry, range(sizes.shape[0])) if e is not None]
    heapq.heapify(heap)
    while heap and heap[0][0] < 0:
        _, layer = heapq.heappop(heap)
        expert = order[layer, position[layer]]
        position[layer] += 1
        if sizes[layer, expert] <= free:
            chosen[layer, expert] = True
            free -= int(sizes[layer, expert])
            gpu[layer] += float(traffic[layer, expert])
            host[layer] -= float(traffic[layer, expert])
        if (nxt := entry(layer)) is not None:
            heapq.heappush(heap, nxt)
    rest = np.flatnonzero(~chosen.ravel())
    chosen.reshape(-1)[rest] = _knapsack(sizes.ravel()[rest], per_token.ravel()[rest], key[rest], free)
    return chosen
