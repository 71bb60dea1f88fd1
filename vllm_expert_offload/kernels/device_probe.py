"""The GPU side of the CPU tier's startup probe (issue 41): how fast the device path reads a host-resident expert
over the link, and what handing a step to the tier costs before any expert is computed. The split (offload/
cpu_tier.py) balances the two tiers on these and on the CPU kernel's probed rates (host_tier.py `probe_rates`).

Both time the real thing rather than a model of it: the layer's own device kernel on one token routed to a host
record (the mapped read as served, launches included), and the layer's own stream tier on a step whose entries
are all the device's (staging copies, two host functions, the copy back and the join, computing nothing). CUDA
events around each run, the L2 written over before each (a host record read twice would otherwise come from L2),
the fastest of PROBE_REPEATS after a warm-up (the others saw interference), each queued behind a GPU sleep so
that the time Python takes to launch it is not counted (a served step replays a graph). Start-up only: each run waits for the
device. The exchange's runs are jobs like any other: their few microseconds of host functions count in the tier's
busy time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .contract import MoEKernel
from .stream_host_tier import StreamHostTier

PROBE_REPEATS = 3
LAUNCH_COVER_CYCLES = 10_000_000  # GPU clock cycles (~5 ms): longer than queuing a timed run from Python takes


def _fastest_seconds(run: Callable[[], object], device: torch.device) -> float:
    """The fastest of PROBE_REPEATS timed runs of `run` on `device`'s current stream, after one untimed run."""
    flush = torch.empty(2 * torch.cuda.get_device_properties(device).L2_cache_size, dtype=torch.uint8, device=device)
    run()
    best = float("inf")
    for _ in range(PROBE_REPEATS):
        flush.zero_()
        torch.cuda._sleep(LAUNCH_COVER_CYCLES)  # the launches below queue behind it: their Python is not timed
        began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        began.record()
        run()
        ended.record()
        ended.synchronize()
        best = min(best, began.elapsed_time(ended) / 1e3)
    return max(best, 1e-9)


def _one_token(hidden: int, top_k: int, dtype: torch.dtype, device: torch.device, expert: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, router weights, top-k ids) of one token whose first slot is `expert` and the others -1 (not this
    path's entry)."""
    x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    ids = torch.full((1, top_k), -1, dtype=torch.int64, device=device)
    ids[0, 0] = expert
    return x, torch.ones(1, top_k, device=device), ids


def device_read_rate(kernel: MoEKernel, expert: int, expert_bytes: int, hidden: int, top_k: int,
                     dtype: torch.dtype, device: torch.device) -> float:
    """Trellis bytes per second at which the layer's device kernel computes host-resident `expert` for one token:
    the device path's rate for the experts the split may move."""
    x, weights, ids = _one_token(hidden, top_k, dtype, device, expert)
    return expert_bytes / _fastest_seconds(lambda: kernel.forward(x, weights, ids, False), device)


def exchange_seconds(tier: StreamHostTier, hidden: int, top_k: int, dtype: torch.dtype, device: torch.device
                     ) -> float:
    """Seconds of the tier's exchange with nothing to compute: its fixed cost per step that gives it any expert."""
    x, weights, ids = _one_token(hidden, top_k, dtype, device, -1)
    return _fastest_seconds(lambda: tier.start(x, weights, ids).result(), device)
