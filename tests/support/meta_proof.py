"""The no-host-sync proof: a backend's forward run with every tensor on the `meta` device.

A meta tensor has a shape and a dtype and no data, so anything the glue does that needs device data on the host
raises by construction, whatever the op is called: `.item()`, `.tolist()`, `.numpy()`, `bool(tensor)`, a
data-dependent shape (boolean-mask indexing, `nonzero`, `unique`, `bincount`, `repeat_interleave` without
`output_size`) and any copy to the host. Kernels run as ops whose meta implementation writes nothing
(kernels/launch_ops.py; the exllamav3 backend's extension is a stand-in of no-op functions here). What the
proof cannot see is inside a launch: that part is checked by capturing CUDA graphs on a GPU.

`BAD_PATTERNS` are the host synchronisations the proof must reject (each one a bug that once passed the op-name
check, NoHostSync in moe_layers.py, or could): tests plant each one in a backend's glue and assert the proof fails.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from vllm_expert_offload.exl3 import Exl3Linear
from vllm_expert_offload.kernels.contract import ExpertCrop, MoELayer
from vllm_expert_offload.kernels.pointer_tables import build_pointer_tables, kernel_address, stack_scales
from vllm_expert_offload.offload.tiers import place_expert

META = torch.device("meta")
# What torch raises for a host read of meta data: RuntimeError (.item()), NotImplementedError (a data-dependent
# shape, a copy out), TypeError (.numpy()); each message names meta, which tests match on.
HOST_SYNC_ON_META = (RuntimeError, NotImplementedError, TypeError)


def meta_moe_layer(
    sets: Sequence[Mapping[str, Exl3Linear]], crop: ExpertCrop, swiglu_limit: float | None = None
) -> MoELayer:
    """The layer of `sets` with every tensor on meta: experts, scale stacks and pointer tables (whose addresses
    are meta data_ptrs, 0: nothing reads them there)."""
    placed = [place_expert(s, True, None, META) for s in sets]
    experts, scales = stack_scales(placed, META)
    tables = build_pointer_tables(experts, kernel_address(None, META), META)
    return MoELayer(experts, tables, scales, None, crop, torch.float32, META, swiglu_limit)


def meta_routing(tokens: int, top_k: int, hidden: int, dtype: torch.dtype = torch.float32):
    """(x, topk_weights, topk_ids) on meta: shapes and dtypes only."""
    return (torch.empty(tokens, hidden, dtype=dtype, device=META),
            torch.empty(tokens, top_k, dtype=torch.float32, device=META),
            torch.empty(tokens, top_k, dtype=torch.int64, device=META))


def tensors_held(obj, seen: set[int] | None = None) -> list[torch.Tensor]:
    """Every tensor reachable from a kernel object's attributes, dataclass fields and containers."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        children = list(obj)
    elif hasattr(obj, "__dict__"):
        children = list(vars(obj).values())
    else:
        return []
    return [t for child in children for t in tensors_held(child, seen)]


def assert_all_on_meta(kernel: object) -> None:
    """The proof's premise: the kernel object holds no tensor with data a forward could read."""
    off_meta = {str(t.device) for t in tensors_held(kernel)} - {"meta"}
    assert not off_meta, f"the kernel holds tensors on {sorted(off_meta)}, not only on meta"


def forward_on_meta(forward: Callable[..., torch.Tensor], *inputs: object) -> torch.Tensor:
    """`forward(*inputs)` with meta inputs; its output must be a meta tensor (nothing came back from a device)."""
    out = forward(*inputs)
    assert out.device == META, f"the forward returned a {out.device} tensor"
    return out


# name -> a host synchronisation on a device tensor (an integer id tensor of the glue).
BAD_PATTERNS: dict[str, Callable[[torch.Tensor], object]] = {
    "item": lambda ids: ids.max().item(),
    "tolist": lambda ids: ids.tolist(),
    "numpy": lambda ids: ids.numpy(),
    "bool of a tensor": lambda ids: bool((ids >= 0).all()),
    "boolean-mask indexing": lambda ids: ids[ids >= 0],
    "nonzero": lambda ids: torch.nonzero(ids),
    "unique": lambda ids: torch.unique(ids),
    "bincount": lambda ids: torch.bincount(ids.reshape(-1).long(), minlength=4),
    "repeat_interleave without output_size": lambda ids: torch.repeat_interleave(ids.reshape(-1).long().clamp(min=0)),
    "copy to a host tensor": lambda ids: torch.empty(ids.shape, dtype=ids.dtype).copy_(ids),
    ".cpu()": lambda ids: ids.cpu(),
}


def planted(function: Callable, pattern: Callable[[torch.Tensor], object], argument: int | str = 0) -> Callable:
    """`function` with `pattern` applied first to its argument `argument` (a glue tensor): positional by index, or
    by keyword."""

    def with_pattern(*args, **kwargs):
        pattern(kwargs[argument] if isinstance(argument, str) else args[argument])
        return function(*args, **kwargs)

    return with_pattern
