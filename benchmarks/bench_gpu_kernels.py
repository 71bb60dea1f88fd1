"""EXL3 kernels on a GPU as vLLM runs them: CUDA-graph replays, fresh routing each replay, L2 cold, beside dense fp16
matmuls of the same shapes and the rooflines the bandwidth probe measured.

    python3 benchmarks/bench_gpu_kernels.py --out bench.jsonl --rooflines probe.jsonl [--budget-s 140]
    TRITON_INTERPRET=1 python3 benchmarks/bench_gpu_kernels.py --smoke --out bench.jsonl   # CPU, code path only

- One MoE layer of Qwen3-30B-A3B (hidden 2048, 768 per expert, 128 experts, top-8) and of DeepSeek-V4.1-Flash as one
  rank of TP 2 holds it (hidden 5120, 1152 of 2304 per expert, 384 experts, top-6), shapes read from
  tests/fixtures/*/config.json, K=3 MUL1 random trellises (any bit pattern is a valid trellis), bf16 activations, at
  1, 8 and 64 tokens with 0/25/50/100 % of the experts (the least popular) in the mapped host arena; per backend that
  runs here (exllamav3 where its extension imports, triton; the torch reference last, eager: it syncs), and beside
  them `torch.matmul` in fp16 over the distinct experts' dense weights (the bytes a dense fp16 MoE reads).
- Routing: per replay a new draw of top-k distinct experts per token (Gumbel top-k) from a Zipf law whose exponent is
  fitted to the routing statistics the project carries (tests/support/routing_fixtures.py, generated; `--routing` takes
  a recorded file instead), copied into the captured graph's input buffers between replays.
- L2 cold as in serving, where the other layers run between two forwards of this one: twice the L2 is written before
  each replay (untimed). Times are CUDA events around one replay; each row gives the median and p90 over at least
  MIN_REPEATS and at most MAX_REPEATS replays, as many as fit ROW_SECONDS.
- Bytes and rooflines per replay: what the distinct experts drawn read from each memory: host-tier experts' trellises
  from the host arena; GPU-tier experts' trellises and every drawn expert's suh/svh from HBM (the scales stay on the
  GPU in both tiers, offload/tiers.py); roofline = HBM bytes / HBM read rate + host bytes / the host read rate in that
  backend's access pattern (probe: triton and exllamav3 patterns, the pinned copy engine for the torch reference),
  serialised (a perfect overlap of the two memories would be their max).
- A dense 4096 x 4096 K=4 linear (exl3_gemm, triton) beside fp16 `torch.matmul`, at 1, 8 and 64 rows, graph-replayed.
Every row is one JSON line appended to --out as it finishes; rows that do not fit --budget-s are written as skipped.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_bandwidth_probe import Clock, JsonLines, choose_device, rooflines  # noqa: E402

from vllm_expert_offload.exl3.naming import PROJECTIONS  # noqa: E402
from vllm_expert_offload.kernels.contract import ExpertCrop, LinearLayer, MoELayer  # noqa: E402
from vllm_expert_offload.kernels.linear import LinearShard  # noqa: E402
from vllm_expert_offload.kernels.oracle import (  # noqa: E402
    KernelChoice,
    build_linear_kernel,
    build_moe_kernel,
    why_unavailable,
)
from vllm_expert_offload.kernels.pointer_tables import build_pointer_tables, kernel_address, stack_scales  # noqa: E402
from vllm_expert_offload.memory import HostArena  # noqa: E402
from vllm_expert_offload.offload.tiers import host_record_bytes, place_expert  # noqa: E402
from vllm_expert_offload.tools.random_layers import random_linear  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODELS = {"qwen3_30b_a3b": 1, "deepseek_v41_flash": 2}  # fixture -> tensor-parallel ranks of the reference deployment
FULL = {"k": 3, "tokens": (1, 8, 64), "host_shares": (0.0, 0.25, 0.5, 1.0), "draws": 64, "min_repeats": 10,
        "max_repeats": 50, "row_seconds": 1.0, "eager_repeats": 3, "dense": 4096, "dense_k": 4, "dense_rows": (1, 8, 64)}
SMOKE = {**FULL, "tokens": (1, 9), "host_shares": (0.0, 1.0), "draws": 3, "min_repeats": 2, "max_repeats": 2,
         "eager_repeats": 1, "dense": 128, "dense_rows": (1, 9)}
SMOKE_MODEL = {"hidden": 128, "intermediate": 128, "experts": 8, "top_k": 2}
BACKENDS = ("exllamav3", "triton", "torch")  # the torch reference last: eager and slow, it goes when time is short


def model_shape(name: str, ranks: int) -> dict:
    """One rank's MoE layer shape, from the fixture's config (the intermediate split over the TP ranks)."""
    config = json.loads((REPO / "tests" / "fixtures" / name / "config.json").read_text())
    config = config.get("text_config", config)
    experts = config.get("num_experts") or config["n_routed_experts"]
    return {"hidden": config["hidden_size"], "intermediate": config["moe_intermediate_size"] // ranks,
            "experts": experts, "top_k": config["num_experts_per_tok"], "tp": ranks}


def zipf_exponent(counts: np.ndarray) -> float:
    """Per layer, the least-squares slope of log(count) against log(rank) over the experts ever selected; the mean."""
    slopes = []
    for row in np.asarray(counts, dtype=float):
        ranked = np.sort(row[row > 0])[::-1]
        if len(ranked) >= 3:
            slopes.append(-np.polyfit(np.log(np.arange(1, len(ranked) + 1)), np.log(ranked), 1)[0])
    if not slopes:
        raise ValueError("no layer has three experts selected: nothing to fit a Zipf law to")
    return float(np.mean(slopes))


def routing_counts(path: Path | None) -> tuple[np.ndarray, str]:
    """[layers, experts] selection counts: a recorded file, or the project's generated Zipf-like traces."""
    if path is not None:
        from vllm_expert_offload.placement import load_routing_dataset

        data = next(iter(load_routing_dataset(path).values()))
        return (data.total() if hasattr(data, "total") else data).counts, str(path)
    sys.path.insert(0, str(REPO / "tests"))
    from support.routing_fixtures import synthetic_routing

    return synthetic_routing(seed=0).trace.total().counts, "tests/support/routing_fixtures.py synthetic_routing(seed=0)"


@dataclass
class Draws:
    """Pre-drawn routings (device tensors, one per replay) and what each reads."""

    ids: torch.Tensor  # int64 (draws, tokens, top_k)
    weights: torch.Tensor  # float32 (draws, tokens, top_k)
    unique: list[np.ndarray]  # the distinct experts of each draw


def draw_routing(popularity: np.ndarray, tokens: int, top_k: int, draws: int, seed: int,
                 device: torch.device) -> Draws:
    rng = np.random.default_rng(seed)
    keys = np.log(popularity)[None, None] + rng.gumbel(size=(draws, tokens, len(popularity)))
    ids = np.argsort(-keys, axis=2)[:, :, :top_k]
    weights = rng.random((draws, tokens, top_k)).astype(np.float32)
    return Draws(torch.from_numpy(ids).to(device), torch.from_numpy(weights / weights.sum(-1, keepdims=True)).to(device),
                 [np.unique(d) for d in ids])


class PlacedLayer:
    """One MoE layer's random experts placed in both tiers once (VRAM copies and host-arena records); a host share
    picks, per expert, which copy the pointer tables address (the least popular experts on host)."""

    def __init__(self, shape: dict, k: float, device: torch.device, out: JsonLines,
                 capture_rows: tuple[int, ...] = ()) -> None:
        """`capture_rows`: the token counts the rows capture CUDA graphs at (the kernels reserve their workspaces
        for them and the real top_k: a capture cannot allocate)."""
        self.capture_rows = tuple(capture_rows)
        gen = torch.Generator(device).manual_seed(0)  # drawn where they are placed: seconds, not minutes, for V4.1
        sizes = {"gate": (shape["hidden"], shape["intermediate"]), "up": (shape["hidden"], shape["intermediate"]),
                 "down": (shape["intermediate"], shape["hidden"])}
        self.shape, self.device = shape, device
        sets = [{p: random_linear(gen, *sizes[p], k) for p in PROJECTIONS} for _ in range(shape["experts"])]
        self.experts = len(sets)
        # Bytes one expert's forward reads: its trellises from its tier, its scales from HBM whatever the tier.
        self.trellis_bytes = sum(sets[0][p].trellis.nbytes for p in PROJECTIONS)
        self.scale_bytes = sum(sets[0][p].suh.nbytes + sets[0][p].svh.nbytes for p in PROJECTIONS)
        self.gpu = [place_expert(s, True, None, device) for s in sets]
        self.arena, self.host, self.arena_error = None, None, None
        try:
            self.arena = HostArena(sum(host_record_bytes(s) for s in sets), device=device)
            self.host = [place_expert(s, False, self.arena, device) for s in sets]
        except (OSError, RuntimeError, ValueError) as exc:  # cudaHostRegister or MADV_DONTFORK refused by this runtime
            self.arena_error = f"{type(exc).__name__}: {exc}"
            out.write({"row": "host_arena", "status": "failed", "error": self.arena_error, "shape": shape})

    def bytes_read(self, gpu_experts: int, host_experts: int) -> tuple[int, int]:
        """(HBM bytes, host bytes) a forward over that many distinct experts of each tier reads."""
        experts = gpu_experts + host_experts
        return gpu_experts * self.trellis_bytes + experts * self.scale_bytes, host_experts * self.trellis_bytes

    def kernel(self, backend: str, on_host: np.ndarray):
        placed = [self.host[e] if on_host[e] else self.gpu[e] for e in range(self.experts)]
        placed, scales = stack_scales(placed, self.device)
        arena = self.arena if on_host.any() else None
        tables = build_pointer_tables(placed, kernel_address(arena, self.device), self.device)
        layer = layer_description(self.shape, self.capture_rows, placed, tables, scales, arena, self.device)
        return build_moe_kernel(KernelChoice(backend, backend, "benchmark"), layer)


def layer_description(shape: dict, capture_rows: tuple[int, ...], placed: list, tables: object, scales: object,
                      arena: HostArena | None, device: torch.device) -> MoELayer:
    """The MoELayer a row's kernel is built from: the model's top_k and the captured token counts, so the Triton
    backend reserves workspaces for every graph the rows capture (a capture cannot allocate)."""
    crop = ExpertCrop(shape["hidden"], shape["intermediate"], 0)
    return MoELayer(placed, tables, scales, arena, crop, torch.bfloat16, device, top_k=shape["top_k"],
                    capture_rows=tuple(capture_rows))


def host_experts(popularity: np.ndarray, share: float) -> np.ndarray:
    """bool per expert: the round(share * experts) least popular ones (a plan keeps the popular ones in VRAM)."""
    on_host = np.zeros(len(popularity), dtype=bool)
    count = round(share * len(popularity))
    if count:
        on_host[np.argsort(popularity)[:count]] = True
    return on_host


def usable_backends(device: torch.device) -> tuple[list[str], dict[str, str]]:
    """The backends that can run on `device`, and why each other one cannot."""
    why_not = {name: why_unavailable(name, device) for name in BACKENDS}
    return [b for b in BACKENDS if why_not[b] is None], {b: why for b, why in why_not.items() if why is not None}


class Timing:
    """Repeats of one forward: CUDA-graph replays (inputs refilled between them) or eager calls."""

    def __init__(self, clock: Clock, shape: dict) -> None:
        self.clock, self.shape = clock, shape

    def repeats(self, first_s: float, eager: bool) -> int:
        if eager:
            return self.shape["eager_repeats"]
        fit = int(self.shape["row_seconds"] / max(first_s, 1e-6))
        return max(self.shape["min_repeats"], min(self.shape["max_repeats"], fit))

    def run(self, forward: Callable[[], torch.Tensor], refill: Callable[[int], object], graph: bool,
            warm: Callable[[], object] | None = None) -> tuple[list[float], str]:
        refill(0)
        forward()  # compiles, allocates scratch, autotunes: never inside a capture
        if warm is not None:
            warm()
        timing = "eager"
        launch = forward
        if graph and self.clock.device.type == "cuda":
            torch.cuda.synchronize()
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                forward()
            launch, timing = captured.replay, "cuda_graph"
        first = self.clock.times(launch, 1, refill)[0]
        return self.clock.times(launch, self.repeats(first, not graph), refill), timing


def _stats(times: list[float]) -> dict:
    ordered = sorted(times)
    return {"repeats": len(times), "median_s": statistics.median(ordered),
            "p90_s": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]}


def roofline_rates(probe: dict | None, backend: str) -> tuple[float, float] | None:
    """(HBM GB/s, host GB/s in this backend's access pattern) from the probe's summary, or None without one."""
    if probe is None:
        return None
    host = probe["host_pattern_gbs"].get(backend, probe["host_read_gbs"])
    return probe["hbm_gbs"], host


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def bench_model(name: str, shape: dict, cfg: dict, popularity: np.ndarray, backends: list[str], probe: dict | None,
                timing: Timing, budget: Budget, out: JsonLines) -> list[tuple]:
    """The graph-replayed rows of one model now; the torch reference's rows returned, to run after everything else."""
    device = timing.clock.device
    layer = PlacedLayer(shape, cfg["k"], device, out, capture_rows=cfg["tokens"])
    base = {"row": "moe", "model": name, **shape, "k": cfg["k"], "codebook": "mul1", "dtype": "bfloat16"}
    deferred = []
    for tokens in cfg["tokens"]:
        draws = draw_routing(popularity, tokens, shape["top_k"], cfg["draws"], seed=tokens, device=device)
        x = torch.randn(tokens, shape["hidden"], generator=torch.Generator().manual_seed(tokens)).to(device,
                                                                                                    torch.bfloat16)
        ids, weights = draws.ids[0].clone(), draws.weights[0].clone()

        def refill(i: int, d=draws, ids=ids, weights=weights) -> None:
            ids.copy_(d.ids[i % len(d.unique)])
            weights.copy_(d.weights[i % len(d.unique)])

        dense_row(name, shape, tokens, draws, x, layer, refill, timing, budget, out)
        for share in cfg["host_shares"]:
            on_host = host_experts(popularity, share)
            for backend in backends:
                row = {**base, "backend": backend, "tokens": tokens, "host_share": share}
                job = (row, layer, on_host, draws, x, ids, weights, refill)
                if backend == "torch":
                    deferred.append(job)
                else:
                    moe_row(*job, probe, timing, budget, out)
    return deferred


def moe_row(row: dict, layer: PlacedLayer, on_host: np.ndarray, draws: Draws, x: torch.Tensor, ids: torch.Tensor,
            weights: torch.Tensor, refill: Callable[[int], object], probe: dict | None, timing: Timing,
            budget: Budget, out: JsonLines) -> None:
    if on_host.any() and layer.arena is None:
        out.write({**row, "skipped": f"no host arena on this machine ({layer.arena_error})"})
        return
    if budget.left() < 5:
        out.write({**row, "skipped": "out of the benchmark's time budget"})
        return
    try:
        kernel = layer.kernel(row["backend"], on_host)
    except ValueError as exc:  # a backend refusing the layer (the exllamav3 constraints)
        out.write({**row, "skipped": str(exc)})
        return
    warm = (lambda: kernel.warm_up(ids.shape[1])) if row["backend"] == "exllamav3" else None
    times, how = timing.run(lambda: kernel.forward(x, weights, ids, False), refill, row["backend"] != "torch", warm)
    reads = [(int((~on_host[u]).sum()), int(on_host[u].sum())) for u in draws.unique]
    used = [reads[i % len(reads)] for i in range(len(times))]
    hbm_bytes, host_bytes = zip(*(layer.bytes_read(g, h) for g, h in used))
    result = {**row, "timing": how, **_stats(times), "hbm_bytes_median": statistics.median(hbm_bytes),
              "host_bytes_median": statistics.median(host_bytes),
              "distinct_experts_median": statistics.median(g + h for g, h in used)}
    rates = roofline_rates(probe, row["backend"])
    if rates is not None:
        per_replay = [g / (rates[0] * 1e9) + h / (rates[1] * 1e9) for g, h in zip(hbm_bytes, host_bytes)]
        result.update(roofline_s=statistics.median(per_replay), roofline_hbm_gbs=rates[0], roofline_host_gbs=rates[1],
                      fraction_of_roofline=statistics.median(per_replay) / result["median_s"])
    out.write(result)


def dense_row(name: str, shape: dict, tokens: int, draws: Draws, x: torch.Tensor, layer: PlacedLayer,
              refill: Callable[[int], object], timing: Timing, budget: Budget, out: JsonLines) -> None:
    """fp16 torch.matmul over as many distinct experts' dense weights as the median draw selects, side by side."""
    distinct = int(statistics.median(len(u) for u in draws.unique))
    row = {"row": "moe_fp16_dense", "model": name, **shape, "tokens": tokens, "distinct_experts": distinct}
    if budget.left() < 5:
        out.write({**row, "skipped": "out of the benchmark's time budget"})
        return
    hidden, inter, device = shape["hidden"], shape["intermediate"], timing.clock.device
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    w13 = torch.randn(hidden, distinct * 2 * inter, device=device, dtype=dtype) / hidden**0.5
    w2 = torch.randn(distinct * inter, hidden, device=device, dtype=dtype) / inter**0.5
    x16 = x.to(dtype)

    def forward() -> torch.Tensor:
        h = (x16 @ w13).view(tokens, distinct, 2, inter)
        return (F.silu(h[:, :, 0]) * h[:, :, 1]).reshape(tokens, distinct * inter) @ w2

    times, how = timing.run(forward, refill, True)
    out.write({**row, "timing": how, **_stats(times), "fp16_bytes": (w13.numel() + w2.numel()) * 2})


def bench_linear(cfg: dict, backends: list[str], timing: Timing, budget: Budget, out: JsonLines) -> None:
    n, k, device = cfg["dense"], cfg["dense_k"], timing.clock.device
    layer = random_linear(torch.Generator().manual_seed(1), n, n, k)
    shards = [LinearShard(layer, 0, n, n, 0, n)]
    dense = (torch.randn(n, n, device=device) / n**0.5).to(torch.float16 if device.type == "cuda" else torch.float32)
    for rows in cfg["dense_rows"]:
        x = torch.randn(rows, n, device=device, dtype=torch.bfloat16)
        x16 = x.to(dense.dtype)
        base = {"row": "linear", "in": n, "out": n, "k": k, "rows": rows}
        times, how = timing.run(lambda: x16 @ dense, lambda i: None, True)
        out.write({**base, "backend": "fp16_matmul", "timing": how, **_stats(times), "bytes": 2 * n * n})
        for backend in backends:
            if backend == "torch" or budget.left() < 5:
                continue
            kernel = build_linear_kernel(KernelChoice(backend, backend, "benchmark"),
                                         LinearLayer(shards, torch.bfloat16, device))
            warm = (lambda: kernel.warm_up([rows])) if backend == "exllamav3" else None
            times, how = timing.run(lambda: kernel.forward(x), lambda i: None, True, warm)
            out.write({**base, "backend": backend, "timing": how, **_stats(times), "bytes": layer.nbytes()})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON lines file to append to")
    parser.add_argument("--rooflines", type=Path, help="benchmarks/gpu_bandwidth_probe.py's JSON lines")
    parser.add_argument("--routing", type=Path, help="a routing statistics file to fit the Zipf law to")
    parser.add_argument("--budget-s", type=float, default=140.0, help="rows that would start after this are skipped")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                        help="the models' layers to measure (each compiles its own kernel variants)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    args = parser.parse_args(argv)
    device = choose_device(parser, args.smoke)
    if args.smoke:
        cfg, models = SMOKE, {"smoke": {**SMOKE_MODEL, "tp": 1}}
    else:
        cfg, models = FULL, {name: model_shape(name, MODELS[name]) for name in args.models}
    out, budget = JsonLines(args.out), Budget(args.budget_s)
    probe = rooflines(args.rooflines) if args.rooflines else None
    counts, source = routing_counts(args.routing)
    exponent = zipf_exponent(counts)
    backends, skipped = usable_backends(device)
    out.write({"row": "setup", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "backends": backends, "skipped_backends": skipped,
               "rooflines": probe, "zipf_exponent": exponent, "routing_source": source, "config": cfg})
    timing = Timing(Clock(device, cfg["min_repeats"]), cfg)
    eager_rows = []
    for name, shape in models.items():
        weights = 1.0 / np.arange(1, shape["experts"] + 1) ** exponent
        popularity = np.random.default_rng(1).permutation(weights / weights.sum())  # hot experts spread over ids
        eager_rows += bench_model(name, shape, cfg, popularity, backends, probe, timing, budget, out)
    bench_linear(cfg, backends, timing, budget, out)
    for job in eager_rows:  # last: the torch reference is eager, slow, and the least informative here
        moe_row(*job, probe, timing, budget, out)
    print_table(args.out)
    return 0


def print_table(path: Path) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    print(f"{'model':20s} {'backend':10s} {'host':>5s} {'tok':>4s} {'median ms':>10s} {'p90 ms':>8s} "
          f"{'roofline ms':>11s} {'fraction':>8s}")
    for r in rows:
        if r.get("row") not in ("moe", "moe_fp16_dense") or "median_s" not in r:
            continue
        roof = f"{r['roofline_s'] * 1e3:.3f}" if "roofline_s" in r else "-"
        frac = f"{r['fraction_of_roofline']:.2f}" if "fraction_of_roofline" in r else "-"
        backend = r.get("backend", "fp16 dense")
        print(f"{r['model']:20s} {backend:10s} {r.get('host_share', 0.0):5.2f} {r['tokens']:4d} "
              f"{r['median_s'] * 1e3:10.3f} {r['p90_s'] * 1e3:8.3f} {roof:>11s} {frac:>8s}")
    for r in rows:
        if "skipped" in r:
            print(f"skipped {r.get('model', '')} {r.get('backend', '')} {r.get('tokens', '')} "
                  f"{r.get('host_share', '')}: {r['skipped']}")


if __name__ == "__main__":
    raise SystemExit(main())
