"""The CPU MoE kernel: a routed-expert layer computed on the host cores, whole, in C++ (csrc/exl3_moe.inc).

Why a kernel of its own rather than the rotated glue around the CPU matmul (cpu_exl3.py): a MoE forward is
five steps (input rotations, gate/up, activation, down, the per-token sum), and in Python each is a handful of
torch ops with their own threads and allocations; here they are one job on a persistent pool of worker threads
(created once per (threads, cpus) in the process, pinned when given CPUs): one list of gate/up then down tile
tasks, the steps between them run by whichever thread completes what they need, each decoded 16x16 tile used for
every row routed to its expert, results independent of the thread count.

It reads the same per-expert trellises the GPU kernels read (an arena record is a host tensor: no copy of the
weights), so the CPU expert tier and the CPU engine's MoE layers run the same code.

Interface, kept stable for the CPU tier and for a GPU stream's host function:

- `CpuMoE(layer, threads=None, cpus=())` from the `MoELayer` every backend gets (kernels/contract.py);
  `forward(x, topk_weights, topk_ids, apply_router_weight_on_input=False) -> out` (tokens, crop.hidden), in x's
  dtype. An id of -1 is skipped (that slot contributes zero: its expert is another tier's); any other id
  outside the layer is refused. Experts whose trellis is not in host memory (GPU tier on a CUDA box) have no
  host address: routing one to this kernel is refused by name.
- The C ABI, for callers without Python (a `cudaLaunchHostFunc` callback): `abi()` gives the addresses of
  `int exl3_moe_submit(Exl3MoeJob*)` (validates and queues the job on the layer's pool, returns at once: 0, or
  -1 with `job->error`) and `int exl3_moe_wait(Exl3MoeJob*)` (blocks until done: 0, or -1 with `job->error`),
  and `sizeof(Exl3MoeJob)`. The struct, in order (C layout, 8-byte aligned on x86-64):
  `const void* layer` (`CpuMoE.handle`), `const float* x`, `int64 x_stride`, `const int32* ids` (tokens, top_k),
  `const float* weights` (tokens, top_k), `int64 tokens`, `int64 top_k`, `int32 route_on_input`, `float* out`,
  `int64 out_stride`, `volatile int32 state` (0 running, 1 done, -1 failed), `char error[240]`.
  x and out are fp32 rows of at least crop.hidden columns; one job per layer in flight at a time.
  `Exl3MoeJob` below is that struct for ctypes.
- For a CUDA stream (the CPU tier on a GPU): `host_abi()` gives `void exl3_moe_host_submit(void*)` and
  `void exl3_moe_host_wait(void*)`, cudaHostFn_t's, on an `Exl3MoeHostJob` (the job, `int64 begun_ns`,
  `int64 busy_ns`: the summed submit-to-done time, `char name[120]`: the layer). A failed job stops the process
  with the layer named on stderr (a host function cannot report to CUDA; csrc/exl3_cpu.cpp says why).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

from ..exl3.naming import PROJECTIONS
from .contract import MoELayer
from .cpu_exl3 import codebook_values, extension
from .cpu_extension import CpuKernelUnavailable
from .matrix_table import CODEBOOK_IDS


def host_trellis_addresses(layer: MoELayer) -> torch.Tensor:
    """(3, experts) int64: each projection's trellis as the host cores read it; 0 where it lives on a GPU only."""
    return torch.tensor([[expert.projections[p].trellis.data_ptr() if expert.projections[p].trellis.device.type == "cpu"
                          else 0 for expert in layer.experts] for p in PROJECTIONS], dtype=torch.int64)


class CpuMoE:
    """One MoE layer on the host cores (module docstring); `threads` defaults to torch's intra-op threads."""

    def __init__(self, layer: MoELayer, threads: int | None = None, cpus: Sequence[int] = ()) -> None:
        self.layer = layer  # owns the trellises and the arena the addresses point into
        self.hidden = layer.crop.hidden
        k = torch.stack([layer.tables.k[p].cpu() for p in PROJECTIONS])
        codebooks = torch.tensor([[CODEBOOK_IDS[cb] for cb in layer.tables.codebooks[p]] for p in PROJECTIONS],
                                 dtype=torch.int32)
        scales = {key: layer.scales[key].detach().to("cpu", torch.float32).contiguous()
                  for key in ((p, side) for p in PROJECTIONS for side in ("suh", "svh"))}
        crop = layer.crop
        self._layer = extension().exl3_moe_layer(
            host_trellis_addresses(layer), (2 * k).round().to(torch.int32), codebooks,
            [scales[(p, "suh")] for p in PROJECTIONS], [scales[(p, "svh")] for p in PROJECTIONS], codebook_values(),
            crop.hidden, crop.offset, crop.offset + crop.intermediate, layer.swiglu_limit,
            threads or torch.get_num_threads(), list(cpus))

    @property
    def handle(self) -> int:
        """What Exl3MoeJob.layer takes (valid while this object lives)."""
        return self._layer.address

    @property
    def threads(self) -> int:
        return self._layer.threads

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                apply_router_weight_on_input: bool = False) -> torch.Tensor:
        """Router-weighted sum over the routed experts of each token (ids -1 skipped), (tokens, crop.hidden)."""
        rows = x.float().contiguous()
        out = torch.empty(x.shape[0], self.hidden, dtype=torch.float32)
        extension().exl3_moe_forward(self._layer, rows, topk_weights.float().contiguous(),
                                     topk_ids.to(torch.int32).contiguous(), apply_router_weight_on_input, out)
        return out.to(x.dtype)


class Exl3MoeJob(ctypes.Structure):
    """The C ABI's job (module docstring), field for field."""

    _fields_ = [("layer", ctypes.c_void_p), ("x", ctypes.c_void_p), ("x_stride", ctypes.c_int64),
                ("ids", ctypes.c_void_p), ("weights", ctypes.c_void_p), ("tokens", ctypes.c_int64),
                ("top_k", ctypes.c_int64), ("route_on_input", ctypes.c_int32), ("out", ctypes.c_void_p),
                ("out_stride", ctypes.c_int64), ("state", ctypes.c_int32), ("error", ctypes.c_char * 240)]


class Exl3MoeHostJob(ctypes.Structure):
    """A job as a CUDA stream's host functions take it (module docstring)."""

    _fields_ = [("job", Exl3MoeJob), ("begun_ns", ctypes.c_int64), ("busy_ns", ctypes.c_int64),
                ("name", ctypes.c_char * 120)]


def abi() -> tuple[int, int, int]:
    """(address of exl3_moe_submit, address of exl3_moe_wait, sizeof(Exl3MoeJob)): the C entry points."""
    submit, wait, size = extension().exl3_moe_abi()
    return submit, wait, size


def host_abi() -> tuple[int, int]:
    """(address of exl3_moe_host_submit, address of exl3_moe_host_wait), checked against this module's struct."""
    submit, wait, size = extension().exl3_moe_host_abi()
    if size != ctypes.sizeof(Exl3MoeHostJob):
        raise CpuKernelUnavailable(f"the compiled CPU kernel's Exl3MoeHostJob is {size} bytes, this module's "
                                   f"{ctypes.sizeof(Exl3MoeHostJob)}: a stale build; rebuild the extension")
    return submit, wait
