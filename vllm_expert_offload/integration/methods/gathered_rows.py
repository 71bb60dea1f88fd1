"""The rows of a MoE layer's batch when vLLM gathers every engine's tokens into it: how many at each batch size vLLM
captures CUDA graphs for (the workspaces' reservation), and which of them are this engine's own (routing statistics,
offload/engine_stats.py says why).

vLLM's capture sizes count one engine's tokens, but a MoE layer under naive dispatch sees more: read against vLLM
0.32/0.33 (`MoERunner._maybe_dispatch`, `AgRsAll2AllManager`), every data-parallel engine's batch is all-gathered
before routing, in DP rank order, engine d contributing `sizes[d]` rows (the step's
`dp_metadata.get_chunk_sizes_across_dp_rank()`; each padded to the same captured size, so DP engines replay the same
graph; an idle engine's dummy batch is all padding in vLLM's `is_padding` mask, moe_runtime.py), a sequence-parallel MoE
gathers each tensor-parallel rank's 1/sp chunk over the EP group, and prefill context parallelism all-gathers its
ranks' tokens too. Workspaces reserved for one engine's rows would be too small inside the capture of a large
batch at DP >= 2, where nothing may be allocated: the layer would fail at startup.

Which rows of such a batch are padding is every engine's `is_padding` mask, all-gathered the way the tokens are
(moe_runtime.py `_batch_padding`). The masks are the same for every MoE layer of a forward, so `step_padding` gathers
them once per forward context (vLLM's `set_forward_context` makes one per forward; DeepSeek-V4.1's replay batch and a
micro-batch have their own): the first MoE layer under it gathers, the later ones reuse the result. Reuse is decided
from what every engine sees alike, so no engine skips a collective another enters: every engine runs the same MoE
layers in the same order under the same contexts (dummy batches of idle engines and captures included; vLLM's own
`moe_layer_index` relies on it), the step's sizes are alike, and whether the stream is capturing a CUDA graph is too
(DP engines capture and replay the same graphs). A layer regathers when its context's gather was for another mask
object, other sizes, or made on the other side of a capture boundary: a mask gathered eagerly is not in a captured
graph (a replay would read a dead forward's values), and one gathered inside a capture is not computed when an eager
segment of that capture runs (DeepSeek-V4.1's replay layers run in such a break during the main graph's capture). A
mask gathered inside a capture is read by the later layers of that same captured forward only, like any activation
passed between vLLM's piecewise graphs, which rewrite it at every replay before they read it.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

from ...errors import ExpertOffloadError


def gathered_capture_rows(capture_sizes: tuple[int, ...], parallel: FusedMoEParallelConfig) -> tuple[int, ...]:
    """The MoE layer's rows at each captured batch size n: each of the sp_size sequence-parallel ranks holds
    ceil(n / sp_size) rows, and the gather stacks every (DP engine, PCP rank, SP rank)'s share; n itself without
    any of them."""
    sp = max(parallel.sp_size, 1)
    ranks = parallel.dp_size * parallel.pcp_size * sp
    return tuple(sorted({-(-n // sp) * ranks for n in capture_sizes}))


class GatheredBatchError(ExpertOffloadError, RuntimeError):
    """A gathered MoE batch that does not split into the engines' shares the step's DP metadata names."""


def splits_into_shares(sizes: list[int] | None, rows: int, dp_size: int) -> bool:
    """The gathered batch of `rows` rows is the `dp_size` engines' shares `sizes`, in DP rank order (vLLM's naive
    dispatch); not so under sequence-parallel MoE or another dispatch."""
    return sizes is not None and len(sizes) == dp_size and sum(sizes) == rows


def own_rows(topk_ids: torch.Tensor, sizes: list[int] | None, dp_rank: int, dp_size: int) -> torch.Tensor:
    """This engine's rows of `topk_ids` [gathered tokens, top_k], gathered from all `dp_size` engines, engine d
    contributing `sizes[d]` rows (the step's `dp_metadata.get_chunk_sizes_across_dp_rank()`)."""
    if not splits_into_shares(sizes, topk_ids.shape[0], dp_size):
        raise GatheredBatchError(
            f"routing statistics under data parallelism: topk_ids of {topk_ids.shape[0]} gathered tokens do not "
            f"split into {dp_size} engines' shares {sizes} (vLLM's dp_metadata); sequence-parallel MoE or another "
            "dispatch than vLLM's naive all-gather is not supported with record_stats"
        )
    start = sum(sizes[:dp_rank])
    return topk_ids[start: start + sizes[dp_rank]]


# Per live forward context (by id, dropped when the context is collected; vLLM's context is not ours to add
# attributes to): the key its gather was made for and the gathered mask.
_STEP_MASKS: dict[int, tuple[tuple, torch.Tensor]] = {}


def step_padding(context: object, padding: torch.Tensor, sizes: list[int],
                 gather: Callable[[], torch.Tensor]) -> torch.Tensor:
    """bool (sum(sizes),): every engine's padding rows of this forward's gathered batch. `gather()` runs the
    collective: in the first MoE layer under `context` (vLLM's forward context), again only for another mask object,
    other sizes or the other side of a capture boundary (module docstring: alike on every engine)."""
    key = (padding, tuple(sizes), torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    held = _STEP_MASKS.get(id(context))
    if held is not None and held[0][0] is key[0] and held[0][1:] == key[1:]:
        return held[1]
    mask = gather()
    if held is None:
        weakref.finalize(context, _STEP_MASKS.pop, id(context), None)
    _STEP_MASKS[id(context)] = (key, mask)
    return mask
