"""Routing statistics under data parallelism: each engine counts its own tokens, one writer saves their sum.

vLLM's naive dispatch gathers every engine's tokens into each MoE layer, so every rank sees them all; but an engine
with no request of its own runs dummy batches so the others' collectives meet, and those would be counted as
traffic. So each engine counts only its own rows of the gathered batch, outside dummy batches, and its first
worker hands the counts over as a report (no file: the engines' workers may live on other machines); the API
server that asked for them merges the reports of all engines and writes the file once.
"""

from __future__ import annotations

from ..errors import ExpertOffloadError
from ..placement import RoutingCounts


class EngineReportError(ExpertOffloadError, ValueError):
    """The engines' reports do not cover each data-parallel rank exactly once."""


def engine_report(dp_rank: int, counts: RoutingCounts) -> dict:
    """What one engine's first worker returns for the save: its DP rank and its own counts, as plain JSON types."""
    return {"dp_rank": dp_rank, "counts": counts.to_json()}


def merge_engine_reports(reports: list[dict], dp_size: int) -> RoutingCounts:
    """The sum of one report per DP rank 0..dp_size-1 (tokens summed, interval spanning all); refused, naming the
    ranks, when one is missing or repeated."""
    ranks = sorted(report["dp_rank"] for report in reports)
    if ranks != list(range(dp_size)):
        raise EngineReportError(f"routing statistics of {dp_size} data-parallel engines need one report from each "
                                f"rank 0..{dp_size - 1}, got ranks {ranks}")
    return RoutingCounts.merge(RoutingCounts.from_json(report["counts"], f"engine {report['dp_rank']}'s counts")
                               for report in reports)
