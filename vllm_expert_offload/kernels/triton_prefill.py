"""Prefill for the experts many slots chose: each decoded once into a workspace, then grouped GEMMs over 32-row
blocks, as exllamav3 switches to dequantize-and-GEMM above 144 rows.

The fused kernels (triton_moe.py) decode a piece of W_hat once per 16-row block: cheapest while an expert has few
slots. An expert with at least `DEQUANT_MIN_ROWS` slots in a batch is instead decoded once per forward here:
1. `triton_dequantize.dequantize`, three launches (gate, up, down) per chunk of experts: gate's and up's input
   rotation folded in, W' = H · W_hat, stored in fp16 for half-precision models; down as decoded (its input is
   finished, rotated, by the gate/up epilogue, as in the fused path).
2. `grouped_gate_up_kernel`: 32 slots of one expert, each A tile ⊙ suh (the fold's scale, per projection) times
   W'(gate) and W'(up), K in steps of `GEMM_BLOCK_K`, the products / √128 once after the loop; the epilogue
   (`triton_moe_steps.store_activation`) rotates both back, ⊙ svh, and stores down's finished input exactly where the fused gate/up kernel stores it.
3. `grouped_down_kernel`: those rows times W_hat(down); the epilogue rotates back, ⊙ svh, times the router
   weight, into the per-slot outputs that the fused path fills for the other experts (one sum kernel follows).
The workspace (triton_dequantize's, shared with dense linears) holds `chunk` experts; the three steps run once per
chunk of consecutive expert ids, a count fixed by the layer. Which experts qualify is read on the device
(`expert_blocks.slot_counts`): no host synchronisation. With a fill table (the expert cache) the dequantize kernel
writes each dense expert's trellis through as it reads it; the fused kernels write the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .expert_blocks import blocks_where, grouped_blocks
from .launch_spec import LaunchArgs, LaunchSpec, arg, constexpr, derived, integer, pointer, strided
from .matrix_table import MatrixTable
from .pointer_tables import ScaleStacks
from .static_spec import LayerShape, StaticKernel
from .triton_dequantize import DEQUANT_MIN_ROWS, DEQUANT_WORKSPACE_BYTES, WORKSPACE, dequantize
from .triton_fused import MATMUL_WARPS, PIECE, RSQRT_128, WORKSPACES, hadamard_signs, product
from .triton_moe_steps import (INPUT_ROWS, KEEP, SWIGLU_LIMIT, Flags, activation_rows, store_activation,
                               store_rotated)

GEMM_BLOCK_M = 32  # at 64 rows the epilogue rotations spill 24-292 B (sm_90, sm_120); at 32 none
GEMM_BLOCK_K = 32
_PIECE: tl.constexpr = tl.constexpr(PIECE)


@triton.jit
def _block(row_ids_ptr, block_matrix_ptr, first, chunk, BLOCK_M: tl.constexpr):
    """(matrix, or -1 where this program's block is not one of this chunk's, its rows, which rows are real)."""
    block = tl.program_id(0)
    matrix = tl.load(block_matrix_ptr + block)
    mine = (matrix >= first) & (matrix < first + chunk)
    rows = tl.load(row_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return tl.where(mine, matrix, -1), rows, rows >= 0


@triton.jit(do_not_specialize=["first"])  # a chunk's first expert: one variant for every chunk
def grouped_gate_up_kernel(
    x_ptr, stride_xm, hidden, route_ptr, stride_r0, stride_r1, row_ids_ptr, block_matrix_ptr, first, chunk, w_ptr,
    matrix_stride, size_k, size_n, suh_gate_ptr, suh_up_ptr, svh_gate_ptr, svh_up_ptr, suh_down_ptr, keep_ptr,
    swiglu_limit, partial_ptr,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP16: tl.constexpr,
    ROUTE_ON_INPUT: tl.constexpr, CLAMP: tl.constexpr, CROP: tl.constexpr,
):
    """Down's finished input for this block's slots and the 128 intermediate channels n0.. (program (block,
    n0 / 128)): (x ⊙ suh) @ W' / √128 for gate and up, W' from the workspace, finished by `store_activation`."""
    matrix, rows, row_ok = _block(row_ids_ptr, block_matrix_ptr, first, chunk, BLOCK_M)
    if matrix >= 0:
        n0 = tl.program_id(1) * _PIECE
        cols = n0 + tl.arange(0, _PIECE)[None, :]
        tokens = tl.where(row_ok, rows // TOP_K, 0)
        gate_w = w_ptr + (matrix - first).to(tl.int64) * matrix_stride
        up_w = gate_w + size_k * size_n
        suh_gate = suh_gate_ptr + matrix * size_k
        suh_up = suh_up_ptr + matrix * size_k
        route = tl.load(route_ptr + tokens * stride_r0 + (rows % TOP_K) * stride_r1, mask=row_ok, other=0.0)
        acc_gate = tl.zeros((BLOCK_M, _PIECE), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, _PIECE), dtype=tl.float32)
        for k0 in range(0, size_k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + tokens[:, None] * stride_xm + ks[None, :],
                        mask=row_ok[:, None] & (ks < hidden)[None, :], other=0.0).to(tl.float32)
            if ROUTE_ON_INPUT:
                a = a * route.to(tl.float32)[:, None]
            acc_gate = product(acc_gate, a * tl.load(suh_gate + ks).to(tl.float32)[None, :],
                               tl.load(gate_w + ks[:, None] * size_n + cols), DOT_FP16)
            acc_up = product(acc_up, a * tl.load(suh_up + ks).to(tl.float32)[None, :],
                             tl.load(up_w + ks[:, None] * size_n + cols), DOT_FP16)
        store_activation(activation_rows(partial_ptr, rows, size_n, DOT_FP16), row_ok, n0, acc_gate * RSQRT_128,
                         acc_up * RSQRT_128, hadamard_signs(_PIECE), svh_gate_ptr + matrix * size_n,
                         svh_up_ptr + matrix * size_n, suh_down_ptr + matrix * size_n, keep_ptr, swiglu_limit, DOT_FP16, CLAMP, CROP)


@triton.jit(do_not_specialize=["first"])
def grouped_down_kernel(
    partial_ptr, route_ptr, stride_r0, stride_r1, row_ids_ptr, block_matrix_ptr, first, chunk, w_ptr,
    matrix_stride, size_k, size_n, svh_down_ptr, out_ptr,
    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP16: tl.constexpr,
    ROUTE_ON_INPUT: tl.constexpr,
):
    """out[slot, n0:+128] for this block's slots (program (block, n0 / 128)): down's finished input times
    W_hat(down) from the workspace, rotated back ⊙ svh and times the router weight by `store_rotated`."""
    matrix, rows, row_ok = _block(row_ids_ptr, block_matrix_ptr, first, chunk, BLOCK_M)
    if matrix >= 0:
        n0 = tl.program_id(1) * _PIECE
        cols = n0 + tl.arange(0, _PIECE)[None, :]
        down_w = w_ptr + (matrix - first).to(tl.int64) * matrix_stride
        act_rows = activation_rows(partial_ptr, rows, size_k, DOT_FP16)
        acc = tl.zeros((BLOCK_M, _PIECE), dtype=tl.float32)
        for k0 in range(0, size_k, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(act_rows + ks[None, :], mask=row_ok[:, None], other=0.0)
            acc = product(acc, a, tl.load(down_w + ks[:, None] * size_n + cols), DOT_FP16)
        route = None  # applied on the input
        if not ROUTE_ON_INPUT:
            route = tl.load(route_ptr + (rows // TOP_K) * stride_r0 + (rows % TOP_K) * stride_r1, mask=row_ok,
                            other=0.0)
        store_rotated(out_ptr + rows[:, None].to(tl.int64) * size_n, row_ok, n0, acc, hadamard_signs(_PIECE),
                      svh_down_ptr + matrix * size_n, DOT_FP16, route)


@dataclass(slots=True)
class ChunkBlocks:
    """One chunk's blocks of slots: the slots sorted into blocks of one expert (row ids, each block's expert), and
    the chunk's experts, `first` .. `first` + `chunk` - 1, whose blocks the GEMMs take."""

    row_ids: torch.Tensor = arg(pointer("row_ids_ptr", "*i32"))
    block_matrix: torch.Tensor = arg(pointer("block_matrix_ptr", "*i32"))
    first: int = arg(integer("first"))
    chunk: int = arg(integer("chunk"))


@dataclass(slots=True)
class Decoded:
    """A projection's decoded experts in the workspace: from the chunk's first expert's matrix on, one expert's
    matrices every `matrix_stride` elements."""

    w: torch.Tensor = arg(pointer("w_ptr", "*fp16"))
    matrix_stride: int = arg(integer("matrix_stride"))


_SCALE = "*fp16"
_ROUTE = strided("route_ptr", "*fp32", ("stride_r0", "stride_r1"), dense=True)  # FusedTritonMoE's dense_rows
# What both GEMMs derive: the product's output width, top-k, rows per block and K per step.
_GEMM = {"size_n": derived("size_n"), "top_k": constexpr("TOP_K"), "block_m": constexpr("BLOCK_M"),
         "block_k": constexpr("BLOCK_K")}


def _gemm(args: LaunchArgs, size_n: int) -> dict[str, int]:
    return dict(size_n=size_n, top_k=args.route.shape[1], block_m=GEMM_BLOCK_M, block_k=GEMM_BLOCK_K)


def _launch_gate_up(args: LaunchArgs) -> None:
    size_n = args.svh_gate.shape[1]
    grouped_gate_up_kernel[(args.blocks.block_matrix.shape[0], size_n // PIECE)](
        **GATE_UP.kernel_kwargs(args, **_gemm(args, size_n)), num_warps=MATMUL_WARPS)


def _launch_down(args: LaunchArgs) -> None:
    size_n = args.out.shape[-1]
    grouped_down_kernel[(args.blocks.block_matrix.shape[0], size_n // PIECE)](
        **DOWN.kernel_kwargs(args, size_k=args.partial.shape[-1], **_gemm(args, size_n)), num_warps=MATMUL_WARPS)


GATE_UP = LaunchSpec("moe_grouped_gate_up_triton", grouped_gate_up_kernel, {
    "x": INPUT_ROWS, "route": _ROUTE, "blocks": ChunkBlocks, "decoded": Decoded, "size_k": integer("size_k"),
    "suh_gate": pointer("suh_gate_ptr", _SCALE), "suh_up": pointer("suh_up_ptr", _SCALE),
    "svh_gate": pointer("svh_gate_ptr", _SCALE), "svh_up": pointer("svh_up_ptr", _SCALE),
    "suh_down": pointer("suh_down_ptr", _SCALE), "keep": KEEP, "swiglu_limit": SWIGLU_LIMIT,
    "partial": pointer("partial_ptr", "*fp32", "Tensor(a!)"), "flags": Flags,
}, derived=_GEMM)
DOWN = LaunchSpec("moe_grouped_down_triton", grouped_down_kernel, {
    "partial": pointer("partial_ptr", "*fp32"), "route": _ROUTE, "blocks": ChunkBlocks, "decoded": Decoded,
    "svh_down": pointer("svh_down_ptr", _SCALE), "out": pointer("out_ptr", "*fp32", "Tensor(a!)"), "flags": Flags,
}, derived={"size_k": derived("size_k"), **_GEMM})
_gate_up = GATE_UP.register(_launch_gate_up)
_down = DOWN.register(_launch_down)


class DequantizedPrefill:
    """The dense experts of a prefill batch (at least `min_rows` slots each) through the three steps of the
    module docstring, chunk by chunk; built with its MoE layer (kernels/triton_moe.py), which calls `forward`
    only for batches of at least `min_rows` tokens (no expert can reach it below)."""

    def __init__(self, tables: dict[str, MatrixTable], scales: ScaleStacks, dtype: torch.dtype,
                 device: torch.device, keep_channels: torch.Tensor | None, swiglu_limit: float | None,
                 min_rows: int = DEQUANT_MIN_ROWS, workspace_bytes: int = DEQUANT_WORKSPACE_BYTES) -> None:
        self.tables = tables
        self.scales = scales
        self.keep_channels = keep_channels
        self.swiglu_limit = swiglu_limit
        self.min_rows = min_rows
        self.device = device
        self.dot_fp16 = dtype in (torch.float16, torch.bfloat16)
        self.weight_dtype = torch.float16 if self.dot_fp16 else torch.float32
        gate, down = tables["gate"], tables["down"]
        self.num_experts = gate.trellis.shape[0]
        self.gate_numel = gate.in_features * gate.out_features
        self.matrix_stride = 2 * self.gate_numel + down.in_features * down.out_features  # one expert's slot
        expert_bytes = self.matrix_stride * self.weight_dtype.itemsize
        self.chunk = chunk_experts(self.num_experts, expert_bytes, workspace_bytes)
        self.workspace_floats = -(-self.chunk * expert_bytes // 4)  # WORKSPACES holds fp32
        WORKSPACES.reserve(device, WORKSPACE, self.workspace_floats)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, counts: torch.Tensor,
                partial: torch.Tensor, y: torch.Tensor, fill: dict[str, torch.Tensor], route_on_input: bool) -> None:
        """Down's finished input (in `partial`, as the fused gate/up kernel stores it) and the per-slot outputs
        (`y`, (1, slots, hidden)) of every slot whose expert has at least `min_rows` slots (`counts`)."""
        row_ids, block_matrix = grouped_blocks(topk_ids.reshape(-1), self.num_experts, GEMM_BLOCK_M, counts)
        block_matrix = blocks_where(block_matrix, counts, self.min_rows, at_least=True)
        w = WORKSPACES.take(self.device, WORKSPACE, (self.workspace_floats,)).view(self.weight_dtype)
        s = self.scales
        offsets = {"gate": 0, "up": self.gate_numel, "down": 2 * self.gate_numel}
        for first in range(0, self.num_experts, self.chunk):
            for p, table in self.tables.items():
                dequantize(table, w, counts=counts, min_rows=self.min_rows, first=first, chunk=self.chunk,
                           offset=offsets[p], matrix_stride=self.matrix_stride, fold=p != "down", fill=fill.get(p))
            blocks = ChunkBlocks(row_ids, block_matrix, first, self.chunk)
            flags = Flags(route_on_input=route_on_input, dot_fp16=self.dot_fp16)
            _gate_up(x=x, route=topk_weights, blocks=blocks, decoded=Decoded(w, self.matrix_stride),
                     size_k=self.tables["gate"].in_features, suh_gate=s[("gate", "suh")], suh_up=s[("up", "suh")],
                     svh_gate=s[("gate", "svh")], svh_up=s[("up", "svh")], suh_down=s[("down", "suh")],
                     keep=self.keep_channels, swiglu_limit=self.swiglu_limit, partial=partial, flags=flags)
            _down(partial=partial, route=topk_weights, blocks=blocks,
                  decoded=Decoded(w[offsets["down"]:], self.matrix_stride), svh_down=s[("down", "svh")], out=y,
                  flags=flags)


def chunk_experts(num_experts: int, expert_bytes: int, workspace_bytes: int) -> int:
    """Experts one chunk decodes into the workspace: as many as its bytes hold, at least one, at most all."""
    return max(1, min(num_experts, workspace_bytes // expert_bytes))


def static_kernels(shape: LayerShape) -> list[StaticKernel]:
    """What `bench-kernels --static` compiles of this module at `shape`, for half-precision models (fp16 weights
    in the workspace): the two grouped GEMMs, which read no trellis (the report gives their registers, spills and
    shared memory; triton_dequantize.py lists the decode). Each specialised as Triton's JIT keys the launch
    (`LaunchSpec.specialised`) with the values a prefill passes at `shape`: the sides, the rows' strides (dense:
    the width, top-k), one expert's stride in the workspace and the experts a default workspace's chunk holds."""
    gemm = dict(TOP_K=shape.top_k, BLOCK_M=GEMM_BLOCK_M, BLOCK_K=GEMM_BLOCK_K, DOT_FP16=True, ROUTE_ON_INPUT=False)
    matrix_stride = 3 * shape.hidden * shape.intermediate
    common = dict(stride_r0=shape.top_k, matrix_stride=matrix_stride,
                  chunk=chunk_experts(shape.experts, 2 * matrix_stride, DEQUANT_WORKSPACE_BYTES))
    kernels = []
    for dtype in ("fp16", "bf16"):
        gate_up = GATE_UP.specialised(f"*{dtype}", dict(common, stride_xm=shape.hidden, hidden=shape.hidden,
                                                        size_k=shape.hidden, size_n=shape.intermediate))
        kernels.append(StaticKernel(f"moe_grouped_gate_up[{dtype}]", grouped_gate_up_kernel, gate_up.signature,
                                    gemm | gate_up.constants | dict(CLAMP=False, CROP=False), MATMUL_WARPS, 3, 0,
                                    dtype=dtype, trellis_arg=None, aligned=gate_up.aligned))
    down = DOWN.specialised("*fp16", dict(common, size_k=shape.intermediate, size_n=shape.hidden))
    kernels.append(StaticKernel("moe_grouped_down[fp16]", grouped_down_kernel, down.signature,
                                gemm | down.constants, MATMUL_WARPS, 3, 0, trellis_arg=None, aligned=down.aligned))
    return kernels
