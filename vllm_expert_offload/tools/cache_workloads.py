"""Routing streams for the cache simulator, built from one folder of shared/data/routing.

A cache needs routing in token order, so each folder becomes a stream of top-k ids [tokens, layers, k] cut into
blocks, each block with the counts a static plan would have been calibrated on *elsewhere*:

- per-token traces with per-prompt counts (moe-beyond): the held-out prompts' traces (1001-2000) in prompt order,
  one block, calibrated on the counts of the prompts that are not in the trace (1-1000), as bench_placement.py does;
- several trace files (speculative-moe): the files in name order, one block each, each calibrated on the others;
- several count files (moe-interp, qwen-hebrew-finetuning, ...): one block of `block_tokens` tokens per set in name
  order, each token's k experts of a layer drawn so that every expert's selection probability is exactly its share
  of the set's counts times k (systematic sampling over a random order; a share above 1/k is capped at certain
  selection); each block calibrated on the sets outside its group (a domain; a task, whatever its language).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..placement import RoutingCounts, RoutingTrace, SegmentedCounts, load_routing_dataset
from ..placement.errors import PlacementError

SAMPLE_CHUNK_TOKENS = 1024  # tokens drawn at once (bounds the [tokens, layers, experts] random draw's memory)


@dataclass(frozen=True)
class Block:
    name: str
    start: int
    end: int
    calibration: np.ndarray  # [layers, experts] counts from data outside this block


@dataclass(frozen=True)
class Workload:
    description: str
    expert_ids: np.ndarray  # [tokens, layers, k] in stream order
    num_experts: int
    blocks: tuple[Block, ...]

    @property
    def shape(self) -> tuple[int, int, int]:
        tokens, layers, k = self.expert_ids.shape
        return tokens, layers, k

    def prefix(self, tokens: int) -> Workload:
        """The stream's first `tokens` tokens, with the blocks that start in them (cut at the end)."""
        blocks = tuple(Block(b.name, b.start, min(b.end, tokens), b.calibration) for b in self.blocks
                       if b.start < tokens)
        return Workload(f"{self.description} (first {tokens} tokens)", self.expert_ids[:tokens], self.num_experts,
                        blocks)


def load_workload(data: Path, *, subset: str | None = None, top_k: int | None = None, block_tokens: int = 10_000,
                  seed: int = 0) -> Workload:
    """The stream of `data` (see the module docstring for what each kind of folder becomes)."""
    traces = sorted(data.glob("*_topk.npz"))
    prompt_counts = sorted(data.glob("*per_prompt_counts.npz"))
    if len(traces) == 1 and len(prompt_counts) == 1:
        return _held_out_prompts(traces[0], prompt_counts[0])
    found = {k: v for k, v in load_routing_dataset(data).items() if subset is None or k.endswith(subset)}
    if not found:
        raise PlacementError(f"{data}: no routing data" + (f" whose name ends with {subset!r}" if subset else ""))
    shapes = {_geometry(v) for v in found.values()}
    if len(shapes) > 1:
        raise PlacementError(f"{data}: the routing sets have different shapes {sorted(shapes)}; pick one model with "
                             f"--subset (set names: {sorted(found)[:8]} ...)")
    if all(isinstance(v, RoutingTrace) for v in found.values()):
        return _trace_files(data, found)
    if all(isinstance(v, RoutingCounts) for v in found.values()):
        if top_k is None:
            raise PlacementError(f"{data}: count data does not say how many experts a token selects; pass --top-k")
        return _count_stream(data, found, top_k, block_tokens, seed)
    raise PlacementError(f"{data}: mixes traces and counts; point --data at one kind, or narrow with --subset")


def _geometry(data: RoutingTrace | RoutingCounts | SegmentedCounts) -> tuple[int, int]:
    if isinstance(data, RoutingTrace):
        return len(data.moe_layers), data.num_experts
    return data.counts.shape[-2], data.counts.shape[-1]


def _held_out_prompts(trace_file: Path, counts_file: Path) -> Workload:
    (trace,) = load_routing_dataset(trace_file).values()
    (per_prompt,) = load_routing_dataset(counts_file).values()
    held_out = set(trace.segment_names)
    calibration = [i for i, name in enumerate(per_prompt.segment_names) if name not in held_out]
    if not calibration:
        raise PlacementError(f"{counts_file}: no prompt outside the trace {trace_file.name} to calibrate on")
    experts = per_prompt.counts.shape[-1]
    block = Block(f"prompts {trace.segment_names[0]}-{trace.segment_names[-1]}", 0, len(trace.expert_ids),
                  per_prompt.total(calibration).counts)
    return Workload(f"per-token traces of {len(held_out)} held-out prompts, calibrated elsewhere on the counts of "
                    f"{len(calibration)} other prompts", trace.expert_ids.astype(np.int64), experts, (block,))


def _trace_files(data: Path, traces: dict[str, RoutingTrace]) -> Workload:
    names = sorted(traces)
    experts = max(t.num_experts for t in traces.values())
    totals = {n: RoutingTrace(t.expert_ids, t.segment_offsets, t.segment_names, t.moe_layers, experts).total().counts
              for n, t in traces.items()}
    blocks, start = [], 0
    for name in names:
        end = start + len(traces[name].expert_ids)
        blocks.append(Block(name, start, end, sum(totals[o] for o in names if o != name)))
        start = end
    ids = np.concatenate([traces[n].expert_ids for n in names]).astype(np.int64)
    return Workload(f"per-token traces of {len(names)} files in name order, each calibrated on the others",
                    ids, experts, tuple(blocks))


def _group(key: str) -> str:
    """A set's group for leave-one-out calibration: a task's languages (qwen-hebrew-finetuning) are one group."""
    if "moe_all_layers_analysis_" in key:
        return key.split("moe_all_layers_analysis_")[1].split("_")[0]
    return key


def _count_stream(data: Path, sets: dict[str, RoutingCounts], top_k: int, block_tokens: int, seed: int) -> Workload:
    names = sorted(sets)
    generator = torch.Generator().manual_seed(seed)
    parts, blocks = [], []
    for i, name in enumerate(names):
        elsewhere = [sets[o].counts for o in names if _group(o) != _group(name)]
        if not elsewhere:
            raise PlacementError(f"{data}: one group of count sets only; nothing to calibrate elsewhere on")
        parts.append(sample_tokens(sets[name].counts, top_k, block_tokens, generator))
        blocks.append(Block(name, i * block_tokens, (i + 1) * block_tokens, sum(elsewhere)))
    experts = sets[names[0]].num_experts
    return Workload(f"{len(names)} count sets in name order, {block_tokens} tokens sampled from each (seeded), each "
                    "calibrated on the sets outside its group", np.concatenate(parts), experts, tuple(blocks))


def inclusion_probabilities(counts: np.ndarray, top_k: int) -> np.ndarray:
    """[layers, experts] probability that a token selects each expert: its count share times k, with any share
    above 1/k capped at certainty and the excess spread over the others in proportion (what k distinct picks allow)."""
    counts = np.asarray(counts, dtype=np.float64)
    if (counts.sum(-1) <= 0).any() or (counts < 0).any() or top_k > (counts > 0).sum(-1).min():
        raise PlacementError(f"every layer needs at least top_k={top_k} experts with positive counts")
    pi = top_k * counts / counts.sum(-1, keepdims=True)
    for _ in range(counts.shape[-1]):
        over = pi > 1
        if not over.any():
            break
        free = ~over & (pi < 1)
        excess = np.where(over, pi - 1, 0).sum(-1, keepdims=True)
        pi = np.where(over, 1.0, pi)
        pi = np.where(free, pi + excess * pi / np.where(free, pi, 0).sum(-1, keepdims=True), pi)
    return np.minimum(pi, 1.0)


def sample_tokens(counts: np.ndarray, top_k: int, tokens: int, generator: torch.Generator) -> np.ndarray:
    """[tokens, layers, k] distinct expert ids per token and layer, each expert with `inclusion_probabilities`.

    Systematic sampling: lay the experts' probabilities end to end in a fresh random order, pick a uniform start u
    in [0, 1) and take the experts under u, u + 1, ..., u + k - 1 (each interval is at most 1 long, so no expert
    is taken twice)."""
    pi = torch.from_numpy(inclusion_probabilities(counts, top_k))
    layers, experts = pi.shape
    out = []
    for start in range(0, tokens, SAMPLE_CHUNK_TOKENS):
        n = min(SAMPLE_CHUNK_TOKENS, tokens - start)
        order = torch.rand(n, layers, experts, generator=generator).argsort(-1)
        edges = torch.gather(pi.expand(n, layers, experts), 2, order).cumsum(-1)
        points = torch.rand(n, layers, 1, generator=generator, dtype=torch.float64) + torch.arange(top_k)
        position = torch.searchsorted(edges, points, right=True).clamp(max=experts - 1)
        out.append(torch.gather(order, 2, position).numpy())
    return np.concatenate(out)
