"""Row lookup over an MXINT-4 engram table kept as stored (exl3/engram.py): codes U8 [rows, dim/2] and E4M3 scale
bytes [rows, dim/32], in pinned host memory on a GPU run (read through a UVA view: each token's rows are gathered
over PCIe, the table is never copied to the GPU) or in plain memory on the CPU.

The lookup reads what vLLM's ParallelEngramEmbedding.lookup reads and writes what it writes: `indices` [T, heads]
are global bucket ids, this rank owns heads [head_start, head_start + local_heads) whose rows are
[vocab_start, vocab_end) of the table; `out` [T, local_heads, dim] receives bf16 rows, zeros for heads past the
table's count (padding for the all-gather) and for ids outside this rank's rows. Pure torch: one gather of the
rows, the decode elementwise on the device, no host synchronization and fixed shapes, so it is captured in CUDA
graphs as is.
"""

from __future__ import annotations

import torch

from ..exl3.engram import MXINT4_PRESCALE, SCALE_BLOCK


def lookup_mxint4(codes: torch.Tensor, scales: torch.Tensor, indices: torch.Tensor, out: torch.Tensor, *,
                  head_start: int, local_heads: int, vocab_start: int) -> None:
    """Write rows of this rank's heads of `indices` into `out` (see the module docstring)."""
    tokens = indices.shape[0]
    rows, half = codes.shape
    heads = indices[:, head_start:head_start + local_heads]
    if heads.shape[1] < local_heads:  # this rank's last heads are padding
        heads = torch.nn.functional.pad(heads, (0, local_heads - heads.shape[1]), value=-1)
    local = heads.to(torch.int64) - vocab_start
    owned = (local >= 0) & (local < rows)
    flat = torch.where(owned, local, 0).reshape(-1)
    packed = codes.index_select(0, flat).to(torch.int16)  # [T * heads, dim/2], the UVA gather
    nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(flat.numel(), 2 * half)
    values = torch.where(nibbles >= 8, nibbles - 16, nibbles).to(torch.float32)
    scale = scales.index_select(0, flat).view(torch.float8_e4m3fn).to(torch.float32) / MXINT4_PRESCALE
    decoded = torch.where(owned.reshape(-1, 1), values * scale.repeat_interleave(SCALE_BLOCK, dim=1), 0.0)
    out.copy_(decoded.reshape(tokens, local_heads, 2 * half))
