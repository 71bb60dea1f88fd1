"""Routing data generated in code, with a fixed seed, for the tests that must run on a bare clone.

The real traces under ../shared/data/routing mostly carry no licence, so the project may not carry copies; these
stand-ins have their shape instead: per-layer expert popularity skewed like a Zipf law (a few hot experts, a long
tail), a different hot set in every layer, and per-token top-k selections of distinct experts drawn from it. They
are written in every file format `load_routing_dataset` reads, laid out as the public datasets lay them out.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vllm_expert_offload.placement import RoutingTrace


@dataclass(frozen=True)
class SyntheticRouting:
    """A trace plus the popularity it was drawn from (probabilities [layers, experts], each row summing to 1)."""

    trace: RoutingTrace
    popularity: np.ndarray


def zipf_popularity(rng: np.random.Generator, layers: int, experts: int, exponent: float = 1.1) -> np.ndarray:
    """Per layer, 1/rank^exponent over a random permutation of the experts (the hot set moves between layers)."""
    weights = 1.0 / np.arange(1, experts + 1) ** exponent
    rows = np.stack([weights[rng.permutation(experts)] for _ in range(layers)])
    return rows / rows.sum(axis=1, keepdims=True)


def synthetic_routing(seed: int = 0, *, layers: int = 6, experts: int = 32, top_k: int = 4,
                      segment_tokens: tuple[int, ...] = (40, 25, 60, 35), moe_layers: tuple[int, ...] | None = None
                      ) -> SyntheticRouting:
    """Per-token top-k selections (distinct experts, drawn without replacement from the layer's popularity)."""
    rng = np.random.default_rng(seed)
    popularity = zipf_popularity(rng, layers, experts)
    tokens = sum(segment_tokens)
    # Gumbel top-k: the k largest of log p + Gumbel noise are a draw of k distinct experts without replacement.
    keys = np.log(popularity)[None] + rng.gumbel(size=(tokens, layers, experts))
    ids = np.argsort(-keys, axis=2)[:, :, :top_k]
    offsets = np.concatenate(([0], np.cumsum(segment_tokens)))
    names = tuple(str(1001 + i) for i in range(len(segment_tokens)))
    layer_ids = moe_layers if moe_layers is not None else tuple(range(layers))
    return SyntheticRouting(RoutingTrace(ids, offsets, names, layer_ids, experts), popularity)


def write_every_format(root: Path, data: SyntheticRouting) -> dict[str, Path]:
    """The data in each format the readers know, plus files a directory load must skip; {format: path}."""
    trace = data.trace
    counts = trace.total().counts
    segmented = trace.segmented()
    layer_ids = np.asarray(trace.moe_layers)
    root.mkdir(parents=True, exist_ok=True)
    files = {
        "npz counts": root / "expert_counts" / "c4.npz",
        "npz float counts": root / "pt" / "arxiv_expert_data.npz",
        "npz segmented": root / "per_prompt_counts.npz",
        "npz trace": root / "prompts_topk.npz",
        "csv trace": root / "eamc" / "prompt_1001_data.csv",
        "csv frequencies": root / "arc_avg_activation.csv",
        "jsonl trace": root / "gsm8k_routing.jsonl",
        "json counts": root / "expert_statistics.json",
    }
    for path in files.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(files["npz counts"], counts=counts)
    np.savez(files["npz float counts"], counts=counts.astype(np.float32), layer_ids=layer_ids)
    np.savez(files["npz segmented"], counts=segmented.counts, prompt_ids=np.array(trace.segment_names))
    np.savez(files["npz trace"], expert_ids=trace.expert_ids, prompt_offsets=trace.segment_offsets,
             prompt_ids=np.array(trace.segment_names), moe_layer_ids=layer_ids)
    _write_trace_csv(files["csv trace"], trace.select([0]))
    _write_frequency_csv(files["csv frequencies"], {"English": counts, "Hebrew": counts[:, ::-1]}, trace)
    _write_jsonl(files["jsonl trace"], trace)
    usage = {str(layer): {str(e): int(c) for e, c in enumerate(row) if c} for layer, row in zip(layer_ids, counts)}
    files["json counts"].write_text(json.dumps({"num_experts": trace.num_experts, "expert_usage_by_layer": usage}))
    # What a directory load must pass over: prose, and pair counts that are not per-expert counts.
    (root / "README.md").write_text("synthetic routing data\n")
    (root / "expert_counts_crosslayer").mkdir(exist_ok=True)
    np.savez(root / "expert_counts_crosslayer" / "c4.npz", pair_counts=np.ones((2, 8, 8), dtype=np.int64))
    return files


def _write_trace_csv(path: Path, trace: RoutingTrace) -> None:
    """moe-beyond's per-prompt layout: rows grouped by layer, tokens in order, ids in selection order."""
    with path.open("w", newline="", encoding="utf-8") as f:
        out = csv.writer(f)
        out.writerow(["Layer ID", "Batch Number", "Token", "Activated Expert IDs"])
        for column, layer in enumerate(trace.moe_layers):
            for token, ids in enumerate(trace.expert_ids[:, column]):
                out.writerow([layer, 0, f"tok{token}", json.dumps(ids.tolist())])


def _write_frequency_csv(path: Path, by_language: dict[str, np.ndarray], trace: RoutingTrace) -> None:
    """Fraction of tokens selecting each expert, per layer and language (qwen-hebrew-finetuning's layout)."""
    tokens = len(trace.expert_ids)
    with path.open("w", newline="", encoding="utf-8") as f:
        out = csv.writer(f)
        out.writerow(["Layer", "Language", *(f"Expert_{e}" for e in range(trace.num_experts))])
        for language, counts in by_language.items():
            for layer, row in zip(trace.moe_layers, counts):
                out.writerow([layer, language, *(repr(float(c) / tokens) for c in row)])


def _write_jsonl(path: Path, trace: RoutingTrace) -> None:
    """speculative-moe's layout: one record per (problem, layer, token); the last token lacks its last layer,
    as a collection stopped mid-step leaves it."""
    with path.open("w", encoding="utf-8") as f:
        for segment, name in enumerate(trace.segment_names):
            start, stop = trace.segment_offsets[segment], trace.segment_offsets[segment + 1]
            for token in range(stop - start):
                for column, layer in enumerate(trace.moe_layers):
                    if token == stop - start - 1 and column == len(trace.moe_layers) - 1:
                        continue
                    ids = trace.expert_ids[start + token, column].tolist()
                    f.write(json.dumps({"dataset": "gsm8k", "problem_id": int(name), "layer": int(layer),
                                        "experts": ids, "token_idx": token}) + "\n")
