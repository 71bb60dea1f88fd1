"""Random EXL3 layers placed and wrapped in a backend, for kernel benchmarks (any bit pattern is a valid
trellis, exl3-format.md §2.5, so speed can be measured without encoding anything). Shipped with the tools
(`bench-kernels`), used by benchmarks/ and tests too; nothing here is test-only."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..exl3 import Codebook, Exl3Linear
from ..exl3.naming import PROJECTIONS
from ..kernels.contract import ExpertCrop, MoELayer
from ..kernels.oracle import KernelChoice, build_moe_kernel
from ..kernels.pointer_tables import build_pointer_tables, kernel_address, stack_scales
from ..memory import HostArena
from ..offload.tiers import host_record_bytes, place_expert


def random_linear(gen: torch.Generator, in_features: int, out_features: int, k: float) -> Exl3Linear:
    """MUL1 set with random trellis, suh of both signs around 1, small positive svh (outputs stay moderate), on the
    generator's device (a CUDA generator draws a large layer's trellises in a fraction of the CPU's time)."""
    on = {"generator": gen, "device": gen.device}
    trellis = torch.randint(-(1 << 15), 1 << 15, (in_features // 16, out_features // 16, int(16 * k)), **on,
                            dtype=torch.int16)
    signs = torch.randint(0, 2, (in_features,), **on) * 2 - 1
    suh = (torch.rand(in_features, **on) + 0.5) * signs
    svh = torch.rand(out_features, **on) * 0.02 + 0.01
    return Exl3Linear("random", trellis, suh.half(), svh.half(), Codebook.MUL1, k)


@dataclass
class RandomMoE:
    kernel: object  # forward(x, topk_weights, topk_ids, apply_router_weight_on_input)
    sets: list[dict[str, Exl3Linear]]  # the source tensor sets (CPU), e.g. for a dense comparison
    gpu_tier: torch.Tensor  # bool (experts,)
    expert_bytes: int  # bytes one expert's three projections read (trellis, scales, marker)
    layer: MoELayer  # what the kernel was built from (another backend can be built from it)


def random_moe(
    hidden: int, intermediate: int, experts: int, k: float, host_share: float, backend: str, device: torch.device,
    dtype: torch.dtype = torch.float16, seed: int = 0, top_k: int = 1, capture_rows: tuple[int, ...] = (),
) -> RandomMoE:
    """One layer whose last `host_share` of experts sit in a host arena, computed by `backend`; `top_k` and
    `capture_rows` as the caller will route and capture CUDA graphs (the kernels reserve their workspaces for
    them: a capture with more experts per token or more rows than reserved raises)."""
    gen = torch.Generator().manual_seed(seed)
    shapes = {"gate": (hidden, intermediate), "up": (hidden, intermediate), "down": (intermediate, hidden)}
    sets = [{p: random_linear(gen, *shapes[p], k) for p in PROJECTIONS} for _ in range(experts)]
    n_host = round(host_share * experts)
    gpu_tier = [e < experts - n_host for e in range(experts)]
    host_bytes = sum(host_record_bytes(s) for s, gpu in zip(sets, gpu_tier) if not gpu)
    arena = HostArena(host_bytes, device=device) if host_bytes else None
    placed = [place_expert(s, gpu, arena, device) for s, gpu in zip(sets, gpu_tier)]
    placed, scales = stack_scales(placed, device)
    tables = build_pointer_tables(placed, kernel_address(arena, device), device)
    layer = MoELayer(placed, tables, scales, arena, ExpertCrop(hidden, intermediate, 0), dtype, device, top_k=top_k,
                     capture_rows=tuple(capture_rows))
    kernel = build_moe_kernel(KernelChoice(backend, backend, "benchmark"), layer)
    expert_bytes = sum(sets[0][p].nbytes() for p in PROJECTIONS)
    return RandomMoE(kernel, sets, torch.tensor(gpu_tier), expert_bytes, layer)


def median_seconds(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median seconds of `fn` after one warm-up (CUDA events on a GPU, wall clock on a CPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)
