"""The profiling flag: up exactly while a runner's profile_run runs, installed once, worst-case routing."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from vllm_expert_offload.integration import vllm_hooks
from vllm_expert_offload.integration.startup import profiling
from vllm_expert_offload.offload.phase import PHASE


@pytest.fixture
def fake_runner(monkeypatch):
    seen = []

    class GPUModelRunner:
        def profile_run(self, randomize_inputs: bool = False) -> None:
            seen.append(PHASE.profiling)

    module = types.ModuleType("vllm.v1.worker.gpu_model_runner")
    module.GPUModelRunner = GPUModelRunner
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_model_runner", module)
    monkeypatch.delitem(sys.modules, "vllm.v1.worker.gpu.model_runner", raising=False)
    return GPUModelRunner, seen


def test_flag_is_up_only_inside_profile_run(fake_runner) -> None:
    runner_cls, seen = fake_runner
    assert vllm_hooks.install_profile_flag() == 1
    assert vllm_hooks.install_profile_flag() == 0, "installing twice must not wrap twice"
    assert not PHASE.profiling
    runner_cls().profile_run()
    assert seen == [True] and not PHASE.profiling


def test_flag_drops_when_profile_run_raises(fake_runner) -> None:
    runner_cls, _ = fake_runner

    def boom(self, randomize_inputs=False):
        raise RuntimeError("out of memory")

    runner_cls.profile_run = boom
    vllm_hooks.install_profile_flag()
    with pytest.raises(RuntimeError):
        runner_cls().profile_run()
    assert not PHASE.profiling


def test_spread_routing_touches_every_expert_with_distinct_picks() -> None:
    ids = torch.zeros(37, 2, dtype=torch.int32)  # a router that sent everything to expert 0
    spread = profiling.spread_routing(ids, 8)
    assert spread.shape == ids.shape and spread.dtype == ids.dtype
    assert set(spread.flatten().tolist()) == set(range(8))
    assert all(len(set(row)) == 2 for row in spread.tolist())
    counts = torch.bincount(spread.flatten().long(), minlength=8)
    assert counts.max() - counts.min() <= 1
