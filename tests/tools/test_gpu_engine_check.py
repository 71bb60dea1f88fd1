"""scripts/gpu_engine_check.py's loading-memory verdict, on made-up per-rank reports (the script itself needs CUDA)."""

from __future__ import annotations

import importlib.util

from support.paths import REPO

SCRIPT = REPO / "scripts" / "gpu_engine_check.py"


def _check():
    spec = importlib.util.spec_from_file_location("gpu_engine_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rank(peak: int, weights: int | None) -> dict:
    return {"tp_rank": 0, "loading_peak_bytes": peak, "model_memory_usage": weights,
            "gpu_tier_expert_bytes": 2**20, "host_tier_expert_bytes": 2**20}


def test_loading_peak_within_the_factor_passes_and_beyond_fails(capsys) -> None:
    check = _check()
    weights = 100 * 2**20
    assert check._loading_peak_ok([_rank(weights, weights)])
    assert check._loading_peak_ok([_rank(int(check.LOADING_PEAK_FACTOR * weights), weights)])
    assert not check._loading_peak_ok([_rank(weights, weights), _rank(2 * weights, weights)])
    assert "FAIL" in capsys.readouterr().out


def test_a_runner_that_does_not_measure_weights_fails() -> None:
    """No measurement is no pass: a CUDA runner always reports model_memory_usage."""
    assert not _check()._loading_peak_ok([_rank(0, None)])
