"""How many device launches one forward makes, counted on the CPU under TRITON_INTERPRET=1.

Every op the forward dispatches counts, except views (no kernel) and `aten::empty*` (an allocation, no kernel),
plus every Triton kernel run; the plugin's launch ops (kernels/launch_ops.py) are not counted themselves, only
the Triton run inside each. What a CUDA graph of the forward would replay, node for node."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.interpreter import InterpretedFunction

from vllm_expert_offload.kernels.launch_ops import LAUNCH_OPS

ALLOCATIONS = ("aten::empty", "aten::empty_strided", "aten::empty_like")


class _TorchOps(TorchDispatchMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if not func.is_view and name not in ALLOCATIONS and name not in LAUNCH_OPS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def count_launches(forward: Callable[..., object], *inputs: object) -> Counter:
    """name -> launches of one `forward(*inputs)`: torch ops by qualified name, Triton kernels as triton:<name>."""
    counts: Counter = Counter()
    run = InterpretedFunction.run

    def counted(self, *args, **kwargs):
        counts[f"triton:{self.fn.__name__}"] += 1
        return run(self, *args, **kwargs)

    InterpretedFunction.run = counted
    try:
        with _TorchOps(counts):
            forward(*inputs)
    finally:
        InterpretedFunction.run = run
    return counts
