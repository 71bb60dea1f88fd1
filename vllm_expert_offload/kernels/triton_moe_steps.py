"""The MoE steps both paths of a routed-expert layer share: the fused kernels (triton_moe.py) and the prefill's
grouped GEMMs over dequantized experts (triton_prefill.py).

- `matrix_facts`: an expert's trellis address, rate, codebook and fill address from its projection's table;
- `store_activation`: the gate/up epilogue that finishes down's input for a 128-wide piece (both rotated back,
  ⊙ svh, clamped, SiLU·up, cropped, ⊙ suh of down, rotated), stored once per slot where down reads it
  (`activation_rows`);
- `store_rotated`: an output piece rotated back, ⊙ svh, times the router weight where given.
Both paths store down's input and the per-slot outputs in the same layout, so one sum kernel serves them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_decode import matrix_rate
from .triton_fused import rotate


@triton.jit
def matrix_facts(trellis_table, twice_k_table, codebook_table, fill_table, matrix, TWICE_K: tl.constexpr,
            CODEBOOK: tl.constexpr, FILL: tl.constexpr):
    """(trellis address, 2K, codebook, fill address or 0) of `matrix` in a table, read once before a kernel's K
    loop (2K and codebook are the constexprs when the table is uniform)."""
    trellis = tl.load(trellis_table + matrix)
    twice_k, codebook = matrix_rate(twice_k_table + matrix, codebook_table + matrix, TWICE_K, CODEBOOK)
    fill = tl.load(fill_table + matrix) if FILL else 0
    return trellis, twice_k, codebook, fill


@triton.jit
def activation_rows(partial_ptr, rows, width, DOT_FP16: tl.constexpr):
    """(M, 1) pointers to the rows of the down kernel's finished input, at the start of the partial workspace: fp16
    for half-precision models (the down product rounds its input to fp16 anyway), fp32 otherwise."""
    if DOT_FP16:
        base = partial_ptr.to(tl.pointer_type(tl.float16))
    else:
        base = partial_ptr
    return base + rows[:, None].to(tl.int64) * width  # int64: slots x width passes 2^31 in long prefills


@triton.jit
def store_activation(act_rows, row_ok, n0, acc_gate, acc_up, signs, svh_gate, svh_up, suh_down, keep_ptr,
                      swiglu_limit, DOT_FP16: tl.constexpr, CLAMP: tl.constexpr, CROP: tl.constexpr):
    """Columns n0..n0+127 of down's input, rotated: had(act(had(gate) ⊙ svh, had(up) ⊙ svh) ⊙ suh(down)), cropped
    to this rank's channels where CROP. A piece is a whole Hadamard block, so it rotates alone."""
    offs = n0 + tl.arange(0, 128)
    gate = rotate(acc_gate, signs, DOT_FP16) * tl.load(svh_gate + offs).to(tl.float32)[None, :]
    up = rotate(acc_up, signs, DOT_FP16) * tl.load(svh_up + offs).to(tl.float32)[None, :]
    scale = tl.load(suh_down + offs).to(tl.float32)
    if CROP:
        scale = scale * tl.load(keep_ptr + offs)
    x = rotate(activation(gate, up, swiglu_limit, CLAMP) * scale[None, :], signs, DOT_FP16)
    tl.store(act_rows + offs[None, :], x.to(act_rows.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def store_rotated(out_rows, row_ok, n0, acc, signs, svh_row, DOT_FP16: tl.constexpr, route=None):
    """Columns n0..n0+127 of the rows at out_rows ((M, 1) pointers): had(acc) ⊙ svh, times the router weights
    `route` (M,) where given."""
    offs = n0 + tl.arange(0, 128)
    y = rotate(acc, signs, DOT_FP16) * tl.load(svh_row + offs).to(tl.float32)[None, :]
    if route is not None:
        y = y * route.to(tl.float32)[:, None]
    tl.store(out_rows + offs[None, :], y, mask=row_ok[:, None])


@triton.jit
def activation(gate, up, swiglu_limit, CLAMP: tl.constexpr):
    """SiLU(gate) · up with vLLM's optional clamp (gate from above, up both ways)."""
    if CLAMP:
        gate = tl.minimum(gate, swiglu_limit)
        up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
    return gate * tl.sigmoid(gate) * up


def activation_args(keep: torch.Tensor | None, swiglu_limit: float | None,
                     partial: torch.Tensor) -> tuple[torch.Tensor, float, dict[str, bool]]:
    """(keep pointer, clamp limit, constexprs) of the activation, which the gate/up kernel applies with one part and
    the down kernel otherwise (the prefill's gate/up GEMM always): without a crop the kernels compile none and get
    an unread tensor for `keep`."""
    crop = keep is not None
    return (keep if crop else partial, 0.0 if swiglu_limit is None else swiglu_limit,
            dict(CLAMP=swiglu_limit is not None, CROP=crop))
