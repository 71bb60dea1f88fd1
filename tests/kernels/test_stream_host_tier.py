"""The CPU tier's jobs in stream order (kernels/stream_host_tier.py), proven here without a GPU: on the CPU the host
job is called through its C function pointer and gives the tier's partial sums of exactly the staged rows; on
`meta` the glue makes no host synchronisation (a layer's whole forward with the tier on: tests/integration/
test_cpu_tier_step.py); a failed job is raised by the next forward, by name. On a GPU: a CUDA graph of the exchange
replays to the host's sums. No vLLM import: scripts/gpu-check.sh runs this file on a machine without vLLM."""

from __future__ import annotations

import pytest
import torch

from vllm_expert_offload.kernels.cpu_exl3 import CPU_MATMUL
from vllm_expert_offload.kernels.stream_host_tier import CpuTierJobError, CudaStreamOrder, StreamHostTier

from support.host_jobs import MAX_TOKENS, InlineOrder, job as _job, meta_tier
from support.meta_proof import BAD_PATTERNS, HOST_SYNC_ON_META, forward_on_meta, meta_routing, planted
from support.moe_layers import FULL, HIDDEN, assert_close_to_reference, other_ranks_slots, placed_moe, routing


@pytest.mark.parametrize("tokens", [1, 3, MAX_TOKENS])
def test_the_host_job_sums_exactly_the_staged_rows_of_the_tiers_entries(tokens: int) -> None:
    reference = placed_moe(FULL, CPU_MATMUL)[0]
    busy: list[float] = []
    job = _job(reference, busy)
    job.out.fill_(7.0)  # rows past this step's must stay as they were
    order = InlineOrder()
    x, weights, ids = routing(tokens, seed=tokens)
    cpu_ids = other_ranks_slots(ids, weights)[0]  # -1: the device's entries (and all of token 0's)
    got = StreamHostTier(job, order).start(x, weights, cpu_ids).result()
    assert torch.equal(got, reference.forward(x, weights, cpu_ids, False))
    assert not got[0].any(), "token 0 has no entry of the tier: nothing added"
    assert order.launches == [(job.address, tokens)] and order.joins == 1 and len(busy) == 1
    assert (job.out[tokens:] == 7.0).all()


def test_a_failed_job_is_raised_by_the_next_forward_naming_the_layer() -> None:
    class Broken:
        def forward(self, x, weights, ids, on_input):
            raise ValueError("no record")

    job = _job(Broken())
    tier = StreamHostTier(job, InlineOrder())
    x, weights, ids = routing(2, seed=1)
    assert tier.start(x, weights, ids).result().isnan().all(), "a failed job's rows are NaN, never stale sums"
    with pytest.raises(CpuTierJobError, match=r"model\.layers\.3\.mlp\.experts: the CPU tier's host job failed: "
                                              r"ValueError\('no record'\)"):
        tier.start(x, weights, ids)


# --- no host synchronisation (CUDA-graph capture) -------------------------------------------------------------


@pytest.mark.parametrize("tokens", [1, 5])
def test_the_stream_glue_runs_with_every_tensor_on_meta(tokens: int) -> None:
    tier, order = meta_tier()
    x, weights, ids = meta_routing(tokens, 2, HIDDEN)
    partial = forward_on_meta(lambda *a: tier.start(*a).result(), x, weights, ids)
    assert partial.shape == (tokens, HIDDEN) and order.launches == [(tier.job.address, tokens)]


@pytest.mark.parametrize("pattern", ["item", "tolist", "boolean-mask indexing", "nonzero", ".cpu()"])
def test_meta_proof_rejects_a_host_sync_planted_in_the_stream_glue(pattern: str) -> None:
    tier, _ = meta_tier()
    start = planted(tier.start, BAD_PATTERNS[pattern], argument=2)
    with pytest.raises(HOST_SYNC_ON_META, match="(?i)meta"):
        start(*meta_routing(3, 2, HIDDEN))


# --- on a GPU ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_a_cuda_graph_of_the_exchange_replays_to_the_hosts_sums() -> None:
    """Captured once at 5 tokens, replayed on new inputs: each replay's partial sums are the host computation's
    of that replay's rows (the user data, 5, fixed at capture), with the side stream joined before the read."""
    cuda = torch.device("cuda")
    reference = placed_moe(FULL, CPU_MATMUL)[0]  # computes on the host, from host tensors
    tier = StreamHostTier(_job(reference), CudaStreamOrder(cuda))
    x, weights, ids = (t.to(cuda) for t in routing(5, seed=2))
    tier.start(x, weights, ids).result()  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tier.start(x, weights, ids).result() * 1.0
    for seed in (3, 4):
        new_x, new_weights, new_ids = routing(5, seed=seed)
        marked = other_ranks_slots(new_ids, new_weights)[0]
        x.copy_(new_x), weights.copy_(new_weights), ids.copy_(marked)
        graph.replay()
        torch.cuda.synchronize()
        assert_close_to_reference(out.cpu(), reference.forward(new_x, new_weights, marked, False))
