"""Routing statistics under data parallelism: each engine's report survives the trip to the API server as plain JSON,
and the merge is the exact sum of one report per DP rank, refused (naming the ranks) when one is missing or repeated."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from vllm_expert_offload.offload.engine_stats import EngineReportError, engine_report, merge_engine_reports
from vllm_expert_offload.placement import PlacementError, RoutingCounts


def _counts(seed: int, tokens: int, interval: tuple[float, float], layers=(0, 1)) -> RoutingCounts:
    rng = np.random.default_rng(seed)
    return RoutingCounts(rng.integers(0, 50, size=(len(layers), 8)), layers, None, tokens, interval)


def _over_the_wire(report: dict) -> dict:
    return json.loads(json.dumps(report))  # what reaches the API server holds plain JSON types only


def test_merge_is_the_sum_of_every_engine() -> None:
    first, second = _counts(1, 10, (100.0, 300.0)), _counts(2, 7, (90.0, 250.0))
    reports = [_over_the_wire(engine_report(1, second)), _over_the_wire(engine_report(0, first))]
    merged = merge_engine_reports(reports, 2)
    np.testing.assert_array_equal(merged.counts, first.counts + second.counts)
    assert merged.moe_layers == (0, 1) and (merged.tokens, merged.interval) == (17, (90.0, 300.0))


@pytest.mark.parametrize("ranks", [[0], [0, 0], [0, 2], [1, 1, 0]])
def test_a_missing_or_repeated_engine_is_refused_by_rank(ranks: list[int]) -> None:
    reports = [engine_report(rank, _counts(rank, 1, (0.0, 1.0))) for rank in ranks]
    with pytest.raises(EngineReportError, match=re.escape(f"one report from each rank 0..1, got ranks {sorted(ranks)}")):
        merge_engine_reports(reports, 2)


def test_engines_of_different_geometry_are_not_summed() -> None:
    reports = [engine_report(0, _counts(0, 1, (0.0, 1.0))), engine_report(1, _counts(1, 1, (0.0, 1.0), (0, 3)))]
    with pytest.raises(PlacementError, match="cannot merge counts"):
        merge_engine_reports(reports, 2)
