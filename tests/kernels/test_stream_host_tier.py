"""The CPU tier's jobs in stream order (kernels/stream_host_tier.py), proven here without a GPU: on the CPU the host
job is called through its C function pointer and gives the tier's partial sums of exactly the staged rows; on
`meta` the glue makes no host synchronisation (a layer's whole forward with the tier on: tests/integration/
test_cpu_tier_step.py); a failed job is raised by the next forward, by name. On a GPU: a CUDA graph of the exchange
replays to the host's sums. No vLLM import: scripts/gpu-check.sh runs this file on a machine without vLLM."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from vllm_expert_offload.kernels.cpu_moe import CpuMoE, Exl3MoeHostJob
from vllm_expert_offload.kernels.stream_host_tier import CudaStreamOrder, StreamHostTier

from support.host_jobs import MAX_TOKENS, InlineOrder, job as _job, meta_tier
from support.meta_proof import BAD_PATTERNS, HOST_SYNC_ON_META, forward_on_meta, meta_routing, planted
from support.moe_layers import FULL, HIDDEN, TIERS, other_ranks_slots, placed_moe, routing


def _kernel(seed: int = 0) -> CpuMoE:
    return placed_moe(FULL, lambda layer: CpuMoE(layer, threads=2), seed=seed)[1]


@pytest.mark.parametrize("tokens", [1, 3, MAX_TOKENS])
def test_the_host_job_sums_exactly_the_staged_rows_of_the_tiers_entries(tokens: int) -> None:
    kernel = _kernel()
    busy: list[float] = []
    job = _job(kernel, busy)
    job.out.fill_(7.0)  # rows past this step's must stay as they were
    order = InlineOrder()
    tier = StreamHostTier(job, order)
    x, weights, ids = routing(tokens, seed=tokens)
    cpu_ids = other_ranks_slots(ids, weights)[0]  # -1: the device's entries (and all of token 0's)
    got = tier.start(x, weights, cpu_ids).result()
    assert torch.equal(got, kernel.forward(x, weights, cpu_ids))
    assert not got[0].any(), "token 0 has no entry of the tier: nothing added"
    address = job.address(tokens)
    assert order.launches == [(job.submit, address), (job.wait, address)] and order.joins == 1
    assert (job.out[tokens:] == 7.0).all()
    assert busy == [], "busy time is reported when the counters are read"
    job.report_busy()
    job.report_busy()  # nothing new since the last report
    assert len(busy) == 1 and busy[0] > 0


def test_one_job_struct_per_step_size_with_its_rows_fixed() -> None:
    """A captured graph keeps the struct's address: each step size has its own, made once, never rewritten."""
    job = _job(_kernel())
    order = InlineOrder()
    tier = StreamHostTier(job, order)
    for tokens in (2, 5, 2):
        x, weights, ids = routing(tokens, seed=tokens)
        tier.start(x, weights, ids).result()
    two, five = job.address(2), job.address(5)
    assert two != five and [a for _, a in order.launches] == [two, two, five, five, two, two]
    assert Exl3MoeHostJob.from_address(two).job.tokens == 2 and Exl3MoeHostJob.from_address(five).job.tokens == 5


_FAILING_CHILD = """
import sys
sys.path[:0] = [sys.argv[1]]
from support.host_jobs import InlineOrder, job
from support.moe_layers import FULL, placed_moe, routing
from vllm_expert_offload.kernels.cpu_moe import CpuMoE
from vllm_expert_offload.kernels.stream_host_tier import StreamHostTier
kernel = placed_moe(FULL, lambda layer: CpuMoE(layer, threads=2))[1]
x, weights, ids = routing(2, seed=1)
ids[1, 1] = 99  # no such expert: the C kernel refuses the job
StreamHostTier(job(kernel), InlineOrder()).start(x, weights, ids).result()
print("served a wrong sum")
"""


def test_a_failed_host_job_stops_the_process_naming_the_layer() -> None:
    """No Python runs on replay, and CUDA takes no error from a host function: the process stops, loudly."""
    child = subprocess.run([sys.executable, "-c", _FAILING_CHILD, str(Path(__file__).parents[1])],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGABRT, child.stdout + child.stderr
    assert "served a wrong sum" not in child.stdout
    assert re.search(r"model\.layers\.3\.mlp\.experts: the CPU tier's host job failed: .*expert id 99 outside",
                     child.stderr), child.stderr


# --- no host synchronisation (CUDA-graph capture) -------------------------------------------------------------


@pytest.mark.parametrize("tokens", [1, 5])
def test_the_stream_glue_runs_with_every_tensor_on_meta(tokens: int) -> None:
    tier, order = meta_tier()
    x, weights, ids = meta_routing(tokens, 2, HIDDEN)
    partial = forward_on_meta(lambda *a: tier.start(*a).result(), x, weights, ids)
    address = tier.job.address(tokens)
    assert partial.shape == (tokens, HIDDEN) and order.launches == [(tier.job.submit, address), (tier.job.wait, address)]


@pytest.mark.parametrize("pattern", ["item", "tolist", "boolean-mask indexing", "nonzero", ".cpu()"])
def test_meta_proof_rejects_a_host_sync_planted_in_the_stream_glue(pattern: str) -> None:
    tier, _ = meta_tier()
    start = planted(tier.start, BAD_PATTERNS[pattern], argument=2)
    with pytest.raises(HOST_SYNC_ON_META, match="(?i)meta"):
        start(*meta_routing(3, 2, HIDDEN))


# --- on a GPU ---------------------------------------------------------------------------------------------------


HOST_ONLY = torch.tensor([not gpu for gpu in TIERS])


def tier_ids(ids: torch.Tensor) -> torch.Tensor:
    """The tier's entries of routed ids: the split never hands a GPU-tier expert to the host."""
    return torch.where(HOST_ONLY[ids], ids, -1)


@pytest.mark.gpu
def test_a_cuda_graph_of_the_exchange_replays_to_the_hosts_sums() -> None:
    """Captured once at 5 tokens, replayed on new inputs: each replay's partial sums are the CPU kernel's of that
    replay's rows (the job struct of 5 rows fixed at capture), with the side stream joined before the read; the
    host-tier experts are read from the mapped arena's host side."""
    cuda = torch.device("cuda")
    kernel = placed_moe(FULL, lambda layer: CpuMoE(layer, threads=2), device=cuda)[1]
    tier = StreamHostTier(_job(kernel), CudaStreamOrder(cuda))
    x, weights, ids = (t.to(cuda) for t in routing(5, seed=2))
    ids.copy_(tier_ids(ids.cpu()))
    tier.start(x, weights, ids).result()  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tier.start(x, weights, ids).result() * 1.0
    for seed in (3, 4):
        new_x, new_weights, new_ids = routing(5, seed=seed)
        marked = tier_ids(new_ids)
        x.copy_(new_x), weights.copy_(new_weights), ids.copy_(marked)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), kernel.forward(new_x, new_weights, marked))


class _LateSide(CudaStreamOrder):
    """A side stream that starts its copies ~25 ms after the fork, long after the caller has moved on."""

    @contextmanager
    def side(self):
        with super().side():
            torch.cuda._sleep(50_000_000)
            yield


@pytest.mark.gpu
def test_the_rows_outlive_the_callers_tensors_until_the_join() -> None:
    """The caller's ids die when the tier's step returns; blocks of their size the current stream takes next and
    overwrites at once must not be what the late side stream copies to the host."""
    cuda = torch.device("cuda")
    kernel = placed_moe(FULL, lambda layer: CpuMoE(layer, threads=2), device=cuda)[1]
    tier = StreamHostTier(_job(kernel), _LateSide(cuda))
    x, weights, ids = routing(4, seed=5)
    marked = tier_ids(ids)
    cpu_ids = marked.to(cuda)
    pending = tier.start(x.to(cuda), weights.to(cuda), cpu_ids)
    del cpu_ids
    reused = [torch.full((4, 2), -1, dtype=kind, device=cuda) for kind in (torch.int64, torch.int32) for _ in range(4)]
    got = pending.result()
    torch.cuda.synchronize()
    assert reused and torch.equal(got.cpu(), kernel.forward(x, weights, marked))
