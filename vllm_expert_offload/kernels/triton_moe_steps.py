"""The MoE steps both paths of a routed-expert layer share: the fused kernels (triton_moe.py) and the prefill's
grouped GEMMs over dequantized experts (triton_prefill.py).

- `matrix_facts`: an expert's trellis address, rate, codebook and fill address from its projection's table;
- `store_activation`: the gate/up epilogue that finishes down's input for a 128-wide piece (both rotated back,
  ⊙ svh, clamped, SiLU·up, cropped, ⊙ suh of down, rotated), stored once per slot where down reads it
  (`activation_rows`);
- `store_rotated`: an output piece rotated back, ⊙ svh, times the router weight where given.
Both paths store down's input and the per-slot outputs in the same layout, so one sum kernel serves them.

And the launch arguments their launches share (kernels/launch_spec.py): a projection's `MatrixArgs`, the `Flags`
every MoE kernel is compiled for, the input rows (`INPUT_ROWS`) and the activation's crop and clamp (`KEEP`,
`SWIGLU_LIMIT`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..errors import InvalidValueError
from .launch_spec import ACTIVATION, Arg, arg
from .matrix_table import MatrixTable
from .triton_decode import matrix_rate
from .triton_fused import rotate


@dataclass(slots=True)
class MatrixArgs:
    """One projection's matrices as a launch passes them (read in the kernel by `matrix_facts`): the MatrixTable's
    device tables, its rate and codebook where uniform (compiled in; else read per matrix) and the expert cache's
    fill table (none: the kernel gets the trellis table, unread, and is compiled without the copy)."""

    trellis: torch.Tensor = arg("Tensor", {"{p}_trellis": "*i64"}, aligned=("{p}_trellis",))
    twice_k: torch.Tensor = arg("Tensor", {"{p}_twice_k": "*i32"}, aligned=("{p}_twice_k",))
    codebook: torch.Tensor = arg("Tensor", {"{p}_codebook": "*i32"}, aligned=("{p}_codebook",))
    fill: torch.Tensor | None = arg("Tensor?", {"{p}_fill": "*i64"}, aligned=("{p}_fill",),
                                    expand=lambda fill, matrices: (matrices.trellis if fill is None else fill,))
    uniform_twice_k: int = arg("int", constexprs=("TWICE_K_{P}",))
    uniform_codebook: int = arg("int", constexprs=("CODEBOOK_{P}",))

    @classmethod
    def of(cls, table: MatrixTable, fill: torch.Tensor | None = None) -> MatrixArgs:
        return cls(table.trellis, table.twice_k, table.codebook, fill, table.uniform_twice_k, table.uniform_codebook)


def writes_through(*projections: MatrixArgs) -> bool:
    """Whether a launch reading `projections` writes them through (the FILL constexpr): all have a fill table or
    none has (a launch without one for some would treat their trellis table as fill addresses)."""
    filled = {p.fill is not None for p in projections}
    if len(filled) > 1:
        raise InvalidValueError("fill tables must be given for every projection of a launch or for none")
    return filled.pop()


@dataclass(slots=True)
class Flags:
    """What every MoE kernel of a forward is compiled for: the router weight on the input rather than the output,
    and fp16 tensor-core products (half-precision models) rather than exact fp32 ones."""

    route_on_input: bool = arg("bool", constexprs=("ROUTE_ON_INPUT",))
    dot_fp16: bool = arg("bool", constexprs=("DOT_FP16",))


# The layer's input rows, as the gate/up kernels read them: the model's activations, row stride, width. The layer
# hands them dense from a 16-byte-aligned start (`dense_rows`); the width is the model's (a multiple of 16 or not).
INPUT_ROWS = Arg("Tensor", {"x_ptr": ACTIVATION, "stride_xm": "i32", "hidden": "i32"},
                 expand=lambda x, _: (x, x.stride(0), x.shape[1]), aligned=("x_ptr",))


def dense_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as the launches declare it (INPUT_ROWS, routing): its last stride 1 and its start 16-byte aligned; `t`
    itself where it is (vLLM's tensors are), else a dense copy (a fresh allocation is aligned): a view such as one
    DP rank's rows of the router weights at top-k 6 starts 24 bytes into a 16-byte line."""
    if t.stride(-1) == 1 and t.data_ptr() % 16 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


# The activation's crop to this rank's channels (a 0/1 vector; none: compiled without, the kernel handed the partial
# workspace, unread) and vLLM's optional clamp (none: compiled without), applied by the gate/up kernel with one part
# and the down kernel otherwise (the prefill's gate/up GEMM always).
KEEP = Arg("Tensor?", {"keep_ptr": "*fp32"}, ("CROP",), aligned=("keep_ptr",),
           expand=lambda keep, args: (args.partial if keep is None else keep, keep is not None))
SWIGLU_LIMIT = Arg("float?", {"swiglu_limit": "fp32"}, ("CLAMP",),
                   expand=lambda limit, _: (0.0 if limit is None else limit, limit is not None))


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
