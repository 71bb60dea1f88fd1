"""How many device launches one forward of a backend's MoE layer or dense linear makes, counted on the CPU.

A forward runs on a tiny random layer (tools/random_layers.py) through the backend's real kernel objects, under
Triton's interpreter (TRITON_INTERPRET=1 must be set before triton is imported) and a TorchDispatchMode. Counted:
every Triton launch (`run` of a jit or interpreted function) and every torch op the forward dispatches that is not
a view (an op whose schema returns an alias of an input, e.g. reshape's view, and `_unsafe_view`, the view of a
temporary that reshape dispatches without saying so in its schema: both are free on a GPU) or an allocation
(`empty`: the caching allocator launches nothing, and a CUDA graph holds no node for it). The plugin's launch
ops (kernels/launch_ops.py) are wrappers around a Triton launch: the launch counts, the wrapper does not. Op counts
depend on the batch shape class (tokens per slot vs grouped), not on the layer's size, so a tiny layer tells the
count of a real one.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..exl3.tensors import Exl3Linear
from ..kernels.contract import Backend, LinearLayer
from ..kernels.launch_ops import LAUNCH_OPS
from ..kernels.linear import LinearShard
from .json_child import resolve, run_json
from .random_layers import random_linear, random_moe

CPU = torch.device("cpu")


# A view whose schema does not say so (reshape of a temporary dispatches it): no device work either.
_HIDDEN_VIEWS = {"aten::_unsafe_view"}
# Allocations: the caching allocator hands out memory without a kernel, and a CUDA graph records no node for them.
_ALLOCATIONS = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty"}


def _is_view(func: torch._ops.OpOverload) -> bool:
    if str(func.overloadpacket._qualified_op_name) in _HIDDEN_VIEWS:
        return True
    return any(ret.alias_info is not None and not ret.alias_info.is_write for ret in func._schema.returns)


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket._qualified_op_name)
        if not _is_view(func) and name not in LAUNCH_OPS and name not in _ALLOCATIONS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def _triton_launches() -> Iterator[Counter[str]]:
    """Counts `kernel[grid](...)` launches of every jit function (compiled or interpreted) while inside."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    launches: Counter[str] = Counter()

    def counting(original: Callable) -> Callable:
        def run(self, *args, grid, warmup, **kwargs):
            if not warmup:
                launches[f"triton::{self.__name__}"] += 1
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)

        return run

    with mock.patch.object(JITFunction, "run", counting(JITFunction.run)), \
            mock.patch.object(InterpretedFunction, "run", counting(InterpretedFunction.run)):
        yield launches


def count_launches(forward: Callable[[], object]) -> Counter[str]:
    """Launches (Triton kernels and non-view torch ops, by name) of one call of `forward`."""
    counter = _OpCounter()
    with _triton_launches() as launches, counter:
        forward()
    return counter.ops + launches


TINY = {"hidden": 128, "intermediate": 128, "experts": 4, "k": 3}
TOP_K = 2


def moe_census(backend: Backend, tokens: int, seed: int = 0) -> Counter[str]:
    """Launches of one MoE forward of `backend` at `tokens` tokens (top-2 of 4 tiny experts, fp16)."""
    moe = random_moe(**TINY, host_share=0.0, backend=backend.name, device=CPU, dtype=torch.float16, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, TINY["hidden"], generator=gen).half()
    ids = torch.stack([torch.randperm(TINY["experts"], generator=gen)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=gen)
    moe.kernel.forward(x, weights, ids, False)  # first call: lazy setup is not a per-forward launch
    return count_launches(lambda: moe.kernel.forward(x, weights, ids, False))


def dense_census(backend: Backend, tokens: int = 1, seed: int = 0) -> Counter[str]:
    """Launches of one forward of a one-shard dense linear (tiny, fp16) of `backend`."""
    gen = torch.Generator().manual_seed(seed)
    layer: Exl3Linear = random_linear(gen, TINY["hidden"], TINY["intermediate"], TINY["k"])
    shard = LinearShard(layer, 0, layer.out_features, layer.out_features, 0, layer.in_features)
    linear = backend.build_linear(LinearLayer([shard], torch.float16, CPU))
    x = torch.randn(tokens, TINY["hidden"], generator=gen).half()
    linear.forward(x)
    return count_launches(lambda: linear.forward(x))


def launch_counts(backend: Backend) -> dict[str, int]:
    """The report's `launches`: MoE forwards at 1, 8 and 64 tokens, a dense linear at 1."""
    counts = {f"moe_{t}": sum(moe_census(backend, t).values()) for t in (1, 8, 64)}
    counts["dense_1"] = sum(dense_census(backend).values())
    return counts


def census_report(backend: str) -> dict[str, int]:
    """`launch_counts` of `backend` ("module:attribute" of a kernels.contract.Backend) in a child Python running
    Triton's interpreter, whatever mode this process runs Triton in."""
    return run_json(__name__, [backend], triton_interpret=True)


if __name__ == "__main__":
    print(json.dumps(launch_counts(resolve(sys.argv[1]))))
