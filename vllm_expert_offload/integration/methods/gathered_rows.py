"""How many rows a MoE layer's `topk_ids` holds at each batch size vLLM captures CUDA graphs for.

vLLM's capture sizes count one engine's tokens, but a MoE layer under naive dispatch sees more: read against vLLM
0.32/0.33 (`MoERunner._maybe_dispatch`, `AgRsAll2AllManager`), every data-parallel engine's batch is all-gathered
before routing (each padded to the same captured size, so DP engines replay the same graph), a sequence-parallel MoE
gathers each tensor-parallel rank's 1/sp chunk over the EP group, and prefill context parallelism all-gathers its
ranks' tokens too. Workspaces reserved for one engine's rows would be too small inside the capture of a large
batch at DP >= 2, where nothing may be allocated: the layer would fail at startup."""

from __future__ import annotations

from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig


def gathered_capture_rows(capture_sizes: tuple[int, ...], parallel: FusedMoEParallelConfig) -> tuple[int, ...]:
    """The MoE layer's rows at each captured batch size n: each of the sp_size sequence-parallel ranks holds
    ceil(n / sp_size) rows, and the gather stacks every (DP engine, PCP rank, SP rank)'s share; n itself without
    any of them."""
    sp = max(parallel.sp_size, 1)
    ranks = parallel.dp_size * parallel.pcp_size * sp
    return tuple(sorted({-(-n // sp) * ranks for n in capture_sizes}))
