"""Expert placement on real routing data: host-read share and a decode-time estimate per strategy.

For every model in shared/data/routing the planner is calibrated on one part of the data and evaluated on another
(held-out prompts, problems, domains or tasks; see SPLITS below), at GPU budgets of 25/50/75 % of the routed expert
bytes, against the placements of llama.cpp (--n-cpu-moe), exllamav3 (--moe_cpu_split) and vLLM (--cpu-offload-params).
It runs on the CPU only: numbers are estimates from the cost model in vllm_expert_offload/placement/cost.py.

    .venv/bin/python benchmarks/bench_placement.py [--data ../shared/data/routing] [--plot docs/img/placement.png]

Prints markdown tables on stdout and writes the plot.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllm_expert_offload.placement import (
    DecodeCostModel,
    RoutingCounts,
    RoutingTrace,
    expected_layer_bytes,
    load_routing_dataset,
    plan_placement,
    trace_layer_bytes,
)

REPO = Path(__file__).resolve().parents[1]
BUDGETS = (0.25, 0.5, 0.75)
LINKS = {  # name: (link bytes/s, GPU memory bytes/s)
    "PCIe 4.0 x16 (25 GB/s), 1.0 TB/s GPU": (25e9, 1.0e12),
    "PCIe 5.0 x16 (51.5 GB/s), 1.79 TB/s GPU": (51.5e9, 1.792e12),
    "GH200 C2C (450 GB/s), 4.0 TB/s GPU": (450e9, 4.0e12),
}
MAIN_LINK = next(iter(LINKS))


@dataclass(frozen=True)
class Model:
    """Shapes from the models' Hugging Face config.json; dense = attention + shared experts + router of a MoE layer."""

    name: str
    hidden: int
    expert_intermediate: int
    matrices: int  # 3: gate/up/down (SwiGLU); 2: wi/wo (Switch)
    top_k: int
    dense_params: int

    def expert_bytes(self, bpw: float) -> int:
        """EXL3 trellis bits plus fp16 suh/svh sign vectors (input + output length) per projection."""
        weights = self.matrices * self.hidden * self.expert_intermediate
        return int(weights * bpw / 8) + 2 * self.matrices * (self.hidden + self.expert_intermediate)

    def dense_bytes(self, bpw: float) -> float:
        return self.dense_params * bpw / 8


def _attention(hidden: int, q_out: int, kv_out: int, o_in: int) -> int:
    return hidden * q_out + 2 * hidden * kv_out + o_in * hidden


DSV2_LITE = Model("DeepSeek-V2-Lite-Chat", 2048, 1408, 3, 6,
                  2048 * 3072 + 2048 * 576 + 512 * 4096 + 2048 * 2048 + 3 * 2048 * 2816 + 64 * 2048)
MIXTRAL = Model("Mixtral-8x7B", 4096, 14336, 3, 2, _attention(4096, 4096, 1024, 4096) + 8 * 4096)
DSMOE_16B = Model("DeepSeekMoE-16B", 2048, 1408, 3, 6, _attention(2048, 2048, 2048, 2048) + 3 * 2048 * 2816)
OLMOE = Model("OLMoE-1B-7B", 2048, 1024, 3, 8, _attention(2048, 2048, 2048, 2048) + 64 * 2048)
QWEN15_MOE = Model("Qwen1.5-MoE-A2.7B", 2048, 1408, 3, 4, _attention(2048, 2048, 2048, 2048) + 3 * 2048 * 5632)
QWEN3_30B = Model("Qwen3-30B-A3B", 2048, 768, 3, 8, _attention(2048, 4096, 512, 4096) + 128 * 2048)
SWITCH_128 = Model("Switch-base-128", 768, 3072, 2, 1, _attention(768, 768, 768, 768) + 128 * 768)


@dataclass(frozen=True)
class Fold:
    calibrate: RoutingCounts
    evaluate: RoutingCounts | RoutingTrace
    weight: float  # tokens for traces; 1 per held-out domain/task for counts


@dataclass(frozen=True)
class Case:
    label: str
    model: Model
    split: str
    folds: tuple[Fold, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return self.folds[0].calibrate.counts.shape


# --- data splits ------------------------------------------------------------------------------------------------


def _leave_one_out(sets: dict[str, RoutingCounts]) -> tuple[Fold, ...]:
    return tuple(
        Fold(RoutingCounts.merge(v for k, v in sets.items() if k != held), sets[held], 1.0) for held in sorted(sets)
    )


def _moe_beyond(data: Path) -> Case:
    root = data / "moe-beyond"
    (trace,) = load_routing_dataset(root / "derived_deepseek_v2_lite_chat_puffin_prompts1001-2000_topk.npz").values()
    (per_prompt,) = load_routing_dataset(
        root / "derived_deepseek_v2_lite_chat_puffin_prompts0001-2000_per_prompt_counts.npz"
    ).values()
    first_half = [i for i, name in enumerate(per_prompt.segment_names) if int(name) <= 1000]
    fold = Fold(per_prompt.total(first_half), trace, float(len(trace.expert_ids)))
    return Case("DeepSeek-V2-Lite-Chat (moe-beyond)", DSV2_LITE,
                "calibrate: counts of prompts 1-1000; evaluate: per-token traces of prompts 1001-2000", (fold,))


def _speculative_moe(data: Path) -> Case:
    root = data / "speculative-moe" / "routing_data_collected"
    traces = {name: next(iter(load_routing_dataset(root / f"{name}_2_routing.jsonl", num_experts=8).values()))
              for name in ("gsm8k", "humaneval")}
    folds = tuple(Fold(traces[a].total(), traces[b], float(len(traces[b].expert_ids)))
                  for a, b in (("gsm8k", "humaneval"), ("humaneval", "gsm8k")))
    return Case("Mixtral-8x7B-Instruct (speculative-moe)", MIXTRAL,
                "cross-domain: calibrate on GSM8K, evaluate per token on HumanEval, and the reverse "
                "(generated tokens, 577 in all)", folds)


def _moe_interp(data: Path, suffix: str, model: Model) -> Case:
    found = load_routing_dataset(data / "moe-interp" / "data-ext" / "pt")
    sets = {k.split("/")[-1].removesuffix(f"_expert_data_{suffix}"): v for k, v in found.items()
            if k.endswith(f"_expert_data_{suffix}")}
    variant = {"base": " base", "chat": " chat"}.get(suffix, "")
    return Case(f"{model.name}{variant} (moe-interp)", model,
                f"leave-one-domain-out over {len(sets)} domains (counts; expected values)", _leave_one_out(sets))


def _allenai(data: Path, name: str, model: Model) -> Case:
    found = load_routing_dataset(data / "OLMoE" / "scripts" / "routing_output" / name / "expert_counts")
    return Case(f"{model.name} (OLMoE repo, layers 0/7/15 only)", model,
                f"leave-one-domain-out over {len(found)} domains (counts; expected values)", _leave_one_out(found))


def _qwen_hebrew(data: Path) -> Case:
    found = load_routing_dataset(data / "qwen-hebrew-finetuning")
    tasks: dict[str, list[RoutingCounts]] = {}
    for key, counts in found.items():
        tasks.setdefault(key.split("moe_all_layers_analysis_")[1].split("_")[0], []).append(counts)
    sets = {task: RoutingCounts.merge(parts) for task, parts in tasks.items()}
    return Case("Qwen3-30B-A3B (qwen-hebrew-finetuning)", QWEN3_30B,
                f"leave-one-task-out over {len(sets)} tasks, English+Hebrew held out together "
                "(selection frequencies; each task weighted equally)", _leave_one_out(sets))


def _spec_moe(data: Path) -> Case:
    (counts,) = load_routing_dataset(data / "specMoE" / "routing_data" / "expert_statistics_3d.json").values()
    return Case("Switch-base-128 (specMoE)", SWITCH_128,
                "IN-SAMPLE: one aggregate count file, no split possible (upper bound for count-based plans)",
                (Fold(counts, counts, 1.0),))


def load_cases(data: Path) -> list[Case]:
    return [
        _moe_beyond(data),
        _speculative_moe(data),
        _moe_interp(data, "base", DSMOE_16B),
        _moe_interp(data, "chat", DSMOE_16B),
        _moe_interp(data, "olmoe", OLMOE),
        _moe_interp(data, "qwen", QWEN15_MOE),
        _allenai(data, "olmoe", OLMOE),
        _allenai(data, "mistral", MIXTRAL),
        _qwen_hebrew(data),
        _spec_moe(data),
    ]


# --- strategies: each returns the host fraction [layers, experts] of every expert's bytes -----------------------

Strategy = Callable[[np.ndarray, int, RoutingCounts, DecodeCostModel, int], np.ndarray]


def planner_counts(sizes, budget, calib, cost, matrices):
    """The planner with routing counts: exact traffic knapsack (= the pure frequency knapsack at equal sizes)."""
    return (~plan_placement(sizes, budget, calib.counts)).astype(float)


def planner_balanced(sizes, budget, calib, cost, matrices):
    return (~plan_placement(sizes, budget, calib.counts, balance_layers=cost)).astype(float)


def planner_no_counts(sizes, budget, calib, cost, matrices):
    return (~plan_placement(sizes, budget)).astype(float)


def exllamav3_tail(sizes, budget, calib, cost, matrices):
    """--moe_cpu_split N: the same tail N expert ids of every layer on host (N the smallest that fits)."""
    layers, experts = sizes.shape
    gpu_per_layer = min(experts, budget // (layers * int(sizes[0, 0])))
    return np.broadcast_to(np.arange(experts) >= gpu_per_layer, sizes.shape).astype(float)


def llamacpp_layers(sizes, budget, calib, cost, matrices):
    """--n-cpu-moe N: all experts of the first N layers on host (N the smallest that fits)."""
    layers, experts = sizes.shape
    gpu_layers = min(layers, budget // (experts * int(sizes[0, 0])))
    return np.broadcast_to((np.arange(layers) < layers - gpu_layers)[:, None], sizes.shape).astype(float)


def vllm_tensors(sizes, budget, calib, cost, matrices):
    """--cpu-offload-params w13_* w2_* --cpu-offload-gb G (UVA): whole parameter tensors in module order.

    vLLM's UVAOffloader walks layers from the first and offloads each matching parameter (w13 = gate+up of every expert
    of the layer, then w2 = down) until G bytes are offloaded; G = total - budget is the least that fits. A layer whose
    w13 went to host but w2 did not reads 2/3 of every selected expert over the link.
    """
    layer_bytes = int(sizes[0].sum())
    tensors = [(matrices - 1) / matrices, 1 / matrices]  # w13 share, w2 share of a layer's expert bytes
    host = np.zeros(sizes.shape)
    offloaded, needed = 0.0, sizes.sum() - budget
    for layer in range(sizes.shape[0]):
        for share in tensors:
            if offloaded >= needed:
                return host
            host[layer] += share
            offloaded += share * layer_bytes
    return host


STRATEGIES: dict[str, Strategy] = {
    "planner (counts)": planner_counts,
    "planner + balance": planner_balanced,
    "planner (no counts)": planner_no_counts,
    "exllamav3 -mcs": exllamav3_tail,
    "llama.cpp --n-cpu-moe": llamacpp_layers,
    "vLLM --cpu-offload-params": vllm_tensors,
}


# --- evaluation ---------------------------------------------------------------------------------------------------


def evaluate(host_fraction, sizes, data, cost) -> tuple[float, float]:
    """(host-read share of routed bytes, seconds per token over the MoE layers in the data)."""
    if isinstance(data, RoutingTrace):
        gpu, host = trace_layer_bytes(host_fraction, sizes, data.expert_ids)
        return host.sum() / (gpu + host).sum(), float(cost.layer_seconds(gpu, host).sum(axis=1).mean())
    gpu, host = expected_layer_bytes(host_fraction, sizes, cost.selections_per_token(data.counts))
    return host.sum() / (gpu + host).sum(), float(cost.layer_seconds(gpu, host).sum())


def run_case(case: Case, strategy: Strategy, fraction: float, cost: DecodeCostModel, bpw: float):
    """Fold-weighted (share, seconds); a fraction of 1.0 with no host experts gives the all-GPU reference."""
    sizes = np.full(case.shape, case.model.expert_bytes(bpw), dtype=np.int64)
    budget = int(sizes.sum() * fraction)
    results = [evaluate(strategy(sizes, budget, f.calibrate, cost, case.model.matrices), sizes, f.evaluate, cost)
               for f in case.folds]
    weights = np.array([f.weight for f in case.folds])
    share, seconds = (np.array(results) * weights[:, None]).sum(axis=0) / weights.sum()
    return float(share), float(seconds)


def cost_for(case: Case, link: str, bpw: float) -> DecodeCostModel:
    link_bw, gpu_bw = LINKS[link]
    return DecodeCostModel(case.model.top_k, link_bw, gpu_bw, case.model.dense_bytes(bpw))


# --- report -------------------------------------------------------------------------------------------------------


def _table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def report(cases: list[Case], bpw: float, plot: Path) -> str:
    names = list(STRATEGIES)
    shares: dict[tuple[str, float, str], float] = {}
    ms: dict[tuple[str, float, str], float] = {}
    for case in cases:
        cost = cost_for(case, MAIN_LINK, bpw)
        for fraction in BUDGETS:
            for name, strategy in STRATEGIES.items():
                shares[case.label, fraction, name], seconds = run_case(case, strategy, fraction, cost, bpw)
                ms[case.label, fraction, name] = 1e3 * seconds
        ms[case.label, 1.0, "all GPU"] = 1e3 * run_case(case, planner_no_counts, 1.0, cost, bpw)[1]

    setup = _table(
        ["data set", "MoE layers x experts (top-k)", "MiB/expert @ %.1f bpw" % bpw, "split"],
        [[c.label, f"{c.shape[0]} x {c.shape[1]} ({c.model.top_k})", f"{c.model.expert_bytes(bpw) / 2**20:.2f}",
          c.split] for c in cases],
    )
    share_rows, time_rows = [], []
    for case in cases:
        for fraction in BUDGETS:
            best_other = min(shares[case.label, fraction, n] for n in names[3:])
            share_rows.append([case.label, f"{fraction:.0%}"]
                              + [f"{100 * shares[case.label, fraction, n]:.1f}" for n in names]
                              + [f"{best_other / max(shares[case.label, fraction, names[0]], 1e-12):.2f}x"])
            time_rows.append([case.label, f"{fraction:.0%}", f"{ms[case.label, 1.0, 'all GPU']:.3f}"]
                             + [f"{ms[case.label, fraction, n]:.3f}" for n in names])
    share_table = _table(["data set", "GPU budget"] + names + ["best prior-art / planner"], share_rows)
    time_table = _table(["data set", "GPU budget", "all GPU"] + names, time_rows)
    _plot(cases, shares, names, plot)
    return "\n\n".join([
        "### Data and splits", setup,
        "### Host-read share (% of routed expert bytes read over the link, held-out data)", share_table,
        f"### Decode-time estimate (ms per token over the MoE layers in the data; {MAIN_LINK})", time_table,
        "### Layer balancing vs plain knapsack (planned and evaluated with the same link)", balance_table(cases, bpw),
    ])


def balance_table(cases: list[Case], bpw: float) -> str:
    rows = []
    for link in LINKS:
        changes = []
        for case in cases:
            cost = cost_for(case, link, bpw)
            for fraction in BUDGETS:
                plain = run_case(case, planner_counts, fraction, cost, bpw)
                balanced = run_case(case, planner_balanced, fraction, cost, bpw)
                changes.append((balanced[1] / plain[1] - 1, balanced[0] - plain[0]))
        change = np.array(changes)
        rows.append([link, f"{100 * change[:, 0].mean():+.2f}", f"{100 * change[:, 0].min():+.2f}",
                     f"{100 * change[:, 0].max():+.2f}", f"{int((change[:, 0] < -0.01).sum())}/{len(change)}",
                     f"{100 * change[:, 1].mean():+.2f}"])
    return _table(["link", "time change, mean %", "best %", "worst %", "runs >1 % faster",
                   "host-share change, mean (points)"], rows)


# Wide translucent lines under thin ones, so strategies that coincide stay visible.
PLOT_STYLES = {
    "planner (counts)": {"color": "C0", "linewidth": 5, "alpha": 0.45},
    "planner + balance": {"color": "C1", "linestyle": ":", "marker": ".", "linewidth": 1.5},
    "planner (no counts)": {"color": "C2", "linewidth": 5, "alpha": 0.45},
    "exllamav3 -mcs": {"color": "C3", "linestyle": "--", "marker": "x", "linewidth": 1.2},
    "llama.cpp --n-cpu-moe": {"color": "C4", "linestyle": "--", "marker": "s", "markersize": 3},
    "vLLM --cpu-offload-params": {"color": "C5", "linestyle": "-.", "marker": "+"},
}


def _plot(cases: list[Case], shares, names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 5
    fig, axes = plt.subplots(-(-len(cases) // cols), cols, figsize=(4 * cols, 7), sharex=True, sharey=True)
    for ax, case in zip(axes.ravel(), cases):
        for name in names:
            ax.plot([100 * f for f in BUDGETS], [100 * shares[case.label, f, name] for f in BUDGETS],
                    label=name, **PLOT_STYLES[name])
        ax.set_title(case.label, fontsize=8)
        ax.grid(alpha=0.3)
    for ax in axes.ravel()[len(cases):]:
        ax.axis("off")
    for ax in axes[-1]:
        ax.set_xlabel("GPU budget (% of expert bytes)")
    for ax in axes[:, 0]:
        ax.set_ylabel("host-read share (%)")
    axes.ravel()[0].legend(fontsize=7)
    fig.suptitle("Routed-expert bytes read from host on held-out routing data (lower is better; "
                 "overlapping lines coincide)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "routing")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "img" / "placement.png")
    parser.add_argument("--bpw", type=float, default=3.0, help="bits per weight of every quantized linear layer")
    args = parser.parse_args()
    print(report(load_cases(args.data), args.bpw, args.plot))


if __name__ == "__main__":
    main()
