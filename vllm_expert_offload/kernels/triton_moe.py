"""One MoE layer's routed experts in three Triton launches: gate+up, down, and the per-token sum.

Rows are slots: slot s = t·top_k + j is token t's j-th pick, expert topk_ids[t, j]. A program takes up to
BLOCK_M (16) slots of one expert and two 128-wide pieces of the output sharing their input (and one part of the
input dimension when it is split), so each (expert, piece) of the trellis is read once per BLOCK_M slots that chose
the expert:
- up to `DEDUP_MAX_TOKENS` tokens: the grid has one program per slot; a program leads when its slot's rank
  among the slots of its expert is a multiple of BLOCK_M, and gathers the slots of that expert ranked from there
  on; the others exit at once. No torch op builds this: the program reads the routing ids itself. Up to
  `DECODE_MAX_TOKENS` tokens (distinct experts per token, vLLM's top-k) no more slots than BLOCK_M share an
  expert, so each selected expert's trellis is read exactly once per forward;
- prefill (more tokens): slots sorted by expert into blocks of 16 (`expert_blocks.grouped_blocks`, a fixed set of
  small torch ops). From `DEQUANT_MIN_ROWS` tokens on, the experts with at least that many slots leave these
  kernels (their blocks are skipped, `expert_blocks.blocks_where`) for triton_prefill.py: decoded once into a
  workspace and multiplied by grouped GEMMs, whose epilogues store into the same per-slot buffers.

1. `moe_gate_up_kernel`: per program, for each 128-wide input piece of its part: x rows (router weight on the
   input when asked), ⊙ suh, rotated in-kernel; gate and up decoded (`triton_decode.decode_block`) and
   multiplied; after the K loop the two fp32 accumulators rotated back, ⊙ svh, and stored as this part's share.
   With one part (`FINISH`: every prefill, and decode where the input is not split) the program finishes its
   piece of down's input instead: clamped (`swiglu_limit`), SiLU(gate)·up, cropped to this rank's channels
   (`keep_channels`, compiled only where this rank drops some), ⊙ suh of down and rotated (a piece is a whole
   Hadamard block), stored once (fp16 for half-precision models) where every down program reads it.
2. `moe_down_kernel` (at decode two output pieces per program): per 128-wide piece of the intermediate, its
   input: finished by the gate/up kernel (`FINISHED`), else gate and up summed over parts in order, activated,
   cropped, ⊙ suh of down and rotated in here, by each down program; down decoded and multiplied; the output
   piece rotated back, ⊙ svh, times the router weight (unless applied on the input), stored per slot and part.
3. `moe_sum_kernel`: each token's slots (and parts) summed in a fixed order (deterministic), cast to the
   model's dtype.
Up to `DECODE_MAX_TOKENS` tokens the kernels split the input dimension of gate/up and of down so that the grid
fills the GPU at batch 1 (`triton_fused.split_for`); larger batches never split. Workspaces come from
`triton_fused.WORKSPACES`, reserved when the layer is built for its largest captured batch.

Write-through (issue #26's expert cache): `fill` tables, one int64 per expert per projection (0 = none, else
the address of a buffer with the same trellis layout). With a fill table, every trellis word the kernels read
of an expert with a fill address is also stored at the same offset of its fill buffer, exactly once per forward
(only the program that leads the expert's first block of slots, and the first part of a split, writes each
piece). Without one the kernels are compiled without the copy and cost nothing more.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from ..errors import InvalidValueError
from ..exl3.naming import PROJECTIONS
from ..memory.arena import HostArena
from ..offload.tiers import PlacedExpert
from .contract import ExpertCrop, MoELayer
from .expert_blocks import blocks_where, grouped_blocks, slot_counts
from .expert_slots import ExpertSlots
from .launch_spec import ACTIVATION, LaunchArgs, LaunchSpec, arg, constexpr, derived, pointer, strided
from .matrix_table import CODEBOOK_IDS_BY_NAME, matrix_table, present_values
from .pointer_tables import PointerTables, ScaleStacks
from .static_spec import LayerShape, StaticKernel
from .triton_fused import (HALF, MATMUL_WARPS, PIECE, SHARED_PER_BLOCK, SM_COUNT, WORKSPACES, fill_target, hadamard_signs,
                           load_row_halves, load_vector_halves, rotated_pieces, shared_per_block, split_for,
                           write_through)
from .triton_dequantize import DEQUANT_MIN_ROWS, DEQUANT_WORKSPACE_BYTES
from .triton_prefill import DequantizedPrefill
from .triton_moe_steps import (INPUT_ROWS, KEEP, SWIGLU_LIMIT, Flags, MatrixArgs, activation, activation_rows,
                               dense_rows, matrix_facts, store_activation, store_rotated, writes_through)

DECODE_MAX_TOKENS = 16  # up to here: the input dimension split to fill the GPU
DEDUP_MAX_TOKENS = 64  # up to here: one program per slot, experts' slots gathered in-kernel; above, sorted by torch
BLOCK_M = 16  # slots per program (tl.dot's minimum); experts with more slots than a prefill's threshold: triton_prefill
SUM_BLOCK = 256  # output columns per program of the sum kernel


@triton.jit
def _block_rows(ids_ptr, stride_i0, stride_i1, row_ids_ptr, block_matrix_ptr, block, num_slots,
                TOP_K: tl.constexpr, DEDUP: tl.constexpr, BLOCK_M: tl.constexpr, SLOTS_P2: tl.constexpr):
    """(matrix or -1 to skip, slot of each of the BLOCK_M rows, which rows are real, writes the fill copy)."""
    m = tl.arange(0, BLOCK_M)
    if DEDUP:
        offs = tl.arange(0, SLOTS_P2)
        every = tl.load(ids_ptr + (offs // TOP_K) * stride_i0 + (offs % TOP_K) * stride_i1,
                        mask=offs < num_slots, other=-1).to(tl.int32)
        mine = tl.load(ids_ptr + (block // TOP_K) * stride_i0 + (block % TOP_K) * stride_i1).to(tl.int32)
        match = every == mine
        rank = tl.cumsum(match.to(tl.int32), 0) - 1
        my_rank = tl.sum(tl.where(offs == block, rank, 0))
        chosen = match[None, :] & (rank[None, :] == my_rank + m[:, None])  # (BLOCK_M, SLOTS_P2)
        rows = tl.sum(tl.where(chosen, offs[None, :], 0), axis=1)
        row_ok = tl.sum(chosen.to(tl.int32), axis=1) > 0
        matrix = tl.where(my_rank % BLOCK_M == 0, mine, -1)
        first = my_rank == 0
    else:
        rows = tl.load(row_ids_ptr + block * BLOCK_M + m)
        row_ok = rows >= 0
        matrix = tl.load(block_matrix_ptr + block)
        before = tl.load(block_matrix_ptr + tl.maximum(block - 1, 0))
        first = (block == 0) | (before != matrix)
    return matrix, rows, row_ok, first


@triton.jit
def _step(acc, acc_second, s_lo, s_hi, signs, trellis, twice_k, codebook, fill, k0, n0, size_n, write, second,
          RATES: tl.constexpr, CODEBOOKS: tl.constexpr, DOT_FP16: tl.constexpr, FILL: tl.constexpr,
          ROTATE: tl.constexpr = True):
    """One input piece of one matrix (`rotated_pieces`: s rotated in, times the piece at n0 and, where `second`,
    at n0 + 128); the pieces' trellis words copied to the matrix's fill address first when this program writes
    through and there is one. RATES, CODEBOOKS: the table's present_keys (the decode's branches)."""
    if FILL:
        if write & (fill != 0):
            write_through(trellis, fill, k0, n0, size_n, twice_k)
            if second:
                write_through(trellis, fill, k0, n0 + 128, size_n, twice_k)
    return rotated_pieces(acc, acc_second, s_lo, s_hi, signs, trellis, k0, n0, size_n, twice_k, codebook, second,
                          RATES, CODEBOOKS, DOT_FP16, ROTATE)


@triton.jit
def _output_pieces(size_n):
    """(first output column, whether a second 128-wide piece follows) of this program: program i takes pieces 2i
    and 2i + 1, the second where the output has it (`_pieces_grid` sizes the grid)."""
    n0 = tl.program_id(1) * 256
    return n0, n0 + 128 < size_n


def slots_p2(num_slots: int, top_k: int, dedup: bool) -> int:
    """SLOTS_P2 of a launch: the power of two the in-kernel dedup's slot vector is padded to, in two widths only, so
    that vLLM's capture sizes share compiled variants (each value is one compile per kernel and worker at startup;
    every power of two up to DEDUP_MAX_TOKENS * top_k made seven): decode batches (up to DECODE_MAX_TOKENS tokens)
    and the rest of the dedup range; 1 where the slots are sorted by torch instead (no dedup)."""
    if not dedup:
        return 1
    tokens = DECODE_MAX_TOKENS if num_slots <= DECODE_MAX_TOKENS * top_k else DEDUP_MAX_TOKENS
    return 1 << (tokens * top_k - 1).bit_length()  # triton.next_power_of_2's value, at a tenth of its host time


def _pieces_grid(size_n: int) -> int:
    """Programs along the output: two 128-wide output pieces a program, sharing their input."""
    return triton.cdiv(size_n, 2 * PIECE)


@triton.jit(do_not_specialize=["num_slots"])  # one variant for every batch size: slots_p2 says why
def moe_gate_up_kernel(
    x_ptr, stride_xm, hidden, route_ptr, stride_r0, stride_r1, ids_ptr, stride_i0, stride_i1, num_slots,
    row_ids_ptr, block_matrix_ptr, suh_gate_ptr, suh_up_ptr, svh_gate_ptr, svh_up_ptr,
    gate_trellis, gate_twice_k, gate_codebook, gate_fill, up_trellis, up_twice_k, up_codebook, up_fill,
    size_k, size_n, steps, partial_ptr, suh_down_ptr, keep_ptr, swiglu_limit,
    TOP_K: tl.constexpr, DEDUP: tl.constexpr, BLOCK_M: tl.constexpr, SLOTS_P2: tl.constexpr,
    TWICE_K_GATE: tl.constexpr, TWICE_K_UP: tl.constexpr, CODEBOOK_GATE: tl.constexpr, CODEBOOK_UP: tl.constexpr,
    DOT_FP16: tl.constexpr, ROUTE_ON_INPUT: tl.constexpr, FILL: tl.constexpr, FINISH: tl.constexpr,
    CLAMP: tl.constexpr, CROP: tl.constexpr,
):
    """partial[part, 0|1, slot, n0:+256] = had(had(x ⊙ suh) @ W_hat(gate|up)) ⊙ svh over this part's input
    pieces: the parts' sum is the projection (the back rotation is linear), rotated once per program here rather
    than once per K step of the down kernel. Two 128-wide output pieces per program share each step's input and
    its two rotations, as in the down kernel. With FINISH (one part) the program stores down's rotated input for
    its pieces instead (`store_activation`), once rather than once per down program."""
    matrix, rows, row_ok, first = _block_rows(ids_ptr, stride_i0, stride_i1, row_ids_ptr, block_matrix_ptr,
                                              tl.program_id(0), num_slots, TOP_K, DEDUP, BLOCK_M, SLOTS_P2)
    if matrix >= 0:
        n0, second = _output_pieces(size_n)
        part = tl.program_id(2)
        tokens = rows // TOP_K
        signs = hadamard_signs(HALF)
        route = tl.load(route_ptr + tokens * stride_r0 + (rows % TOP_K) * stride_r1, mask=row_ok, other=0.0)
        acc_gate = tl.zeros((BLOCK_M, 128), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, 128), dtype=tl.float32)
        acc_gate_second = tl.zeros((BLOCK_M, 128), dtype=tl.float32)
        acc_up_second = tl.zeros((BLOCK_M, 128), dtype=tl.float32)
        gate = matrix_facts(gate_trellis, gate_twice_k, gate_codebook, gate_fill, matrix, TWICE_K_GATE,
                            CODEBOOK_GATE, FILL)
        up = matrix_facts(up_trellis, up_twice_k, up_codebook, up_fill, matrix, TWICE_K_UP, CODEBOOK_UP, FILL)
        per_part = tl.cdiv(steps, tl.num_programs(2))
        for step in range(part * per_part, tl.minimum(steps, (part + 1) * per_part)):
            k0 = step * 128
            a_lo, a_hi = load_row_halves(x_ptr + tokens[:, None] * stride_xm, row_ok, k0, hidden)
            if ROUTE_ON_INPUT:
                a_lo = a_lo * route.to(tl.float32)[:, None]
                a_hi = a_hi * route.to(tl.float32)[:, None]
            suh_lo, suh_hi = load_vector_halves(suh_gate_ptr + matrix * size_k, k0)
            acc_gate, acc_gate_second = _step(acc_gate, acc_gate_second, a_lo * suh_lo, a_hi * suh_hi, signs, *gate,
                                              k0, n0, size_n, first, second, TWICE_K_GATE, CODEBOOK_GATE, DOT_FP16,
                                              FILL)
            suh_lo, suh_hi = load_vector_halves(suh_up_ptr + matrix * size_k, k0)
            acc_up, acc_up_second = _step(acc_up, acc_up_second, a_lo * suh_lo, a_hi * suh_hi, signs, *up, k0, n0,
                                          size_n, first, second, TWICE_K_UP, CODEBOOK_UP, DOT_FP16, FILL)
        signs = hadamard_signs(128)
        svh_gate = svh_gate_ptr + matrix * size_n
        svh_up = svh_up_ptr + matrix * size_n
        if FINISH:  # one part: this piece of down's input, finished here
            act_rows = activation_rows(partial_ptr, rows, size_n, DOT_FP16)
            suh_down = suh_down_ptr + matrix * size_n
            store_activation(act_rows, row_ok, n0, acc_gate, acc_up, signs, svh_gate, svh_up, suh_down, keep_ptr,
                             swiglu_limit, DOT_FP16, CLAMP, CROP)
            if second:
                store_activation(act_rows, row_ok, n0 + 128, acc_gate_second, acc_up_second, signs, svh_gate,
                                 svh_up, suh_down, keep_ptr, swiglu_limit, DOT_FP16, CLAMP, CROP)
        else:
            gate_rows = partial_ptr + (part * 2 * num_slots + rows[:, None]) * size_n
            up_rows = gate_rows + num_slots * size_n
            store_rotated(gate_rows, row_ok, n0, acc_gate, signs, svh_gate, DOT_FP16)
            store_rotated(up_rows, row_ok, n0, acc_up, signs, svh_up, DOT_FP16)
            if second:
                store_rotated(gate_rows, row_ok, n0 + 128, acc_gate_second, signs, svh_gate, DOT_FP16)
                store_rotated(up_rows, row_ok, n0 + 128, acc_up_second, signs, svh_up, DOT_FP16)


@triton.jit(do_not_specialize=["num_slots"])
def moe_down_kernel(
    partial_ptr, gate_parts, route_ptr, stride_r0, stride_r1, ids_ptr, stride_i0, stride_i1, num_slots,
    row_ids_ptr, block_matrix_ptr, keep_ptr, suh_down_ptr, svh_down_ptr,
    swiglu_limit, down_trellis, down_twice_k, down_codebook, down_fill, size_k, size_n, steps, out_ptr,
    TOP_K: tl.constexpr, DEDUP: tl.constexpr, BLOCK_M: tl.constexpr, SLOTS_P2: tl.constexpr,
    TWICE_K_DOWN: tl.constexpr, CODEBOOK_DOWN: tl.constexpr, DOT_FP16: tl.constexpr, ROUTE_ON_INPUT: tl.constexpr,
    CLAMP: tl.constexpr, CROP: tl.constexpr, FILL: tl.constexpr, FINISHED: tl.constexpr,
):
    """out[part, slot, n0:+256] = route · had(act(gate, up) ⊙ suh @ W_hat(down)) ⊙ svh over this part's pieces,
    gate and up the sums of the gate/up kernel's parts (already rotated back); with FINISHED the gate/up kernel left
    act(gate, up) ⊙ suh already rotated, and the K loop only decodes and multiplies. Two 128-wide output pieces per
    program (the second where the output has it) share each step's input."""
    matrix, rows, row_ok, first = _block_rows(ids_ptr, stride_i0, stride_i1, row_ids_ptr, block_matrix_ptr,
                                              tl.program_id(0), num_slots, TOP_K, DEDUP, BLOCK_M, SLOTS_P2)
    if matrix >= 0:
        n0, second = _output_pieces(size_n)
        part = tl.program_id(2)
        signs = hadamard_signs(HALF)
        acc = tl.zeros((BLOCK_M, 128), dtype=tl.float32)
        acc_second = tl.zeros((BLOCK_M, 128), dtype=tl.float32)
        down = matrix_facts(down_trellis, down_twice_k, down_codebook, down_fill, matrix, TWICE_K_DOWN,
                            CODEBOOK_DOWN, FILL)
        act_rows = activation_rows(partial_ptr, rows, size_k, DOT_FP16)
        per_part = tl.cdiv(steps, tl.num_programs(2))
        for step in range(part * per_part, tl.minimum(steps, (part + 1) * per_part)):
            k0 = step * 128
            if FINISHED:  # the gate/up kernel's one part left down's rotated input
                x_lo, x_hi = load_row_halves(act_rows, row_ok, k0, size_k, 0, True)
                acc, acc_second = _step(acc, acc_second, x_lo, x_hi, signs, *down, k0, n0, size_n, first, second,
                                        TWICE_K_DOWN, CODEBOOK_DOWN, DOT_FP16, FILL, False)
            else:
                gate_lo = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
                gate_hi = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
                up_lo = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
                up_hi = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
                for gate_part in range(gate_parts):  # in order: deterministic
                    where = partial_ptr + (gate_part * 2 * num_slots + rows[:, None]) * size_k
                    lo, hi = load_row_halves(where, row_ok, k0, size_k)
                    gate_lo += lo
                    gate_hi += hi
                    lo, hi = load_row_halves(where + num_slots * size_k, row_ok, k0, size_k)
                    up_lo += lo
                    up_hi += hi
                suh_lo, suh_hi = load_vector_halves(suh_down_ptr + matrix * size_k, k0)
                if CROP:  # this rank's channels only
                    keep_lo, keep_hi = load_vector_halves(keep_ptr, k0)
                    suh_lo = suh_lo * keep_lo
                    suh_hi = suh_hi * keep_hi
                act_lo = activation(gate_lo, up_lo, swiglu_limit, CLAMP) * suh_lo
                act_hi = activation(gate_hi, up_hi, swiglu_limit, CLAMP) * suh_hi
                acc, acc_second = _step(acc, acc_second, act_lo, act_hi, signs, *down, k0, n0, size_n, first, second,
                                        TWICE_K_DOWN, CODEBOOK_DOWN, DOT_FP16, FILL)
        signs = hadamard_signs(128)
        route = None  # applied on the input
        if not ROUTE_ON_INPUT:
            route = tl.load(route_ptr + (rows // TOP_K) * stride_r0 + (rows % TOP_K) * stride_r1, mask=row_ok,
                            other=0.0)
        out_rows = out_ptr + (part * num_slots + rows[:, None]).to(tl.int64) * size_n  # slots x hidden >= 2^31
        store_rotated(out_rows, row_ok, n0, acc, signs, svh_down_ptr + matrix * size_n, DOT_FP16, route)
        if second:
            store_rotated(out_rows, row_ok, n0 + 128, acc_second, signs, svh_down_ptr + matrix * size_n, DOT_FP16,
                           route)


@triton.jit(do_not_specialize=["parts", "num_slots"])
def moe_sum_kernel(y_ptr, ids_ptr, stride_i0, stride_i1, parts, num_slots, size_n, hidden, out_ptr, stride_om,
                   TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[t, n] = Σ_j Σ_part y[part, t·top_k + j, n], in that fixed order, cast to out's dtype; a slot of expert -1
    (not this rank's) adds nothing: no kernel wrote its rows. Row offsets are int64: a prefill of 37k tokens at
    top-8 and hidden 7168 has more than 2^31 floats of y."""
    token = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(TOP_K):
        width = tl.where(tl.load(ids_ptr + token * stride_i0 + j * stride_i1) >= 0, hidden, 0)
        for part in range(parts):
            row = (part * num_slots + token * TOP_K + j).to(tl.int64)  # slots x hidden reaches 2^31 in a prefill
            acc += tl.load(y_ptr + row * size_n + offs, mask=offs < width, other=0.0)
    tl.store(out_ptr + token * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


# moe_gate_up_kernel's shared memory, bytes (Triton 3.9's allocation, AOT-compiled for sm_120, the decode variants at
# K = 1, 4, 5, 8 and 2 or 3 stages; tests/kernels/test_pipeline_stages.py compiles the tightest case): a base, and per
# pipeline stage beyond the first a copy of one K step's loads, the x halves and 2 KiB per trellis bit of a weight
# (fp32 models: 36,864 + (stages - 1) * (12,288 + 4,096 K); half precision: 18,432 + (stages - 1) * (4,096 + 4,096 K)).
# Exact where it decides (fp32 K = 4/5/8, fp16 K = 8, sm_90 and sm_120 alike) and for fp32 below (K = 1/2/3 at 3
# stages on sm_120: 69,632 / 77,824 / 86,016 B, 12-04); half precision below K = 4 may take more (bf16 K = 3:
# 60,416 B, the compile census), far under either limit.
# fp32's base is 512 B above the figures above since the static report compiles the variant a GPU launches (unit
# strides constant, 16-aligned arguments): fp32 K = 8 at 2 stages on sm_120 takes 82,432 B, not 81,920 (12-04).
_GATE_UP_BASE = {True: 18_432, False: 37_376}  # by DOT_FP16
_GATE_UP_X_STAGE = {True: 4_096, False: 12_288}
MAX_STAGES = 3  # Triton's default: the loop's loads issued two steps ahead


def gate_up_shared_bytes(twice_k: int, dot_fp16: bool, stages: int) -> int:
    """moe_gate_up_kernel's shared memory at `stages` for the widest rate `twice_k` (2K) it decodes."""
    return _GATE_UP_BASE[dot_fp16] + (stages - 1) * (_GATE_UP_X_STAGE[dot_fp16] + 2_048 * twice_k)


def gate_up_stages(twice_k_gate: int, twice_k_up: int, dot_fp16: bool, limit: int | None) -> int:
    """Pipeline stages of moe_gate_up_kernel: the deepest (at most MAX_STAGES) whose shared memory fits the
    device's `limit` per block (None: no limit, the interpreter). `twice_k_*` are the tables' present_keys: a mixed
    table is sized for the widest rate it holds. Why: at Triton's default of 3, an fp32 model's gate/up needs
    102,400 B at K = 5 and 126,976 B at K = 8, more than sm_120's 101,376 B: the launch would fail with
    OutOfResources in vLLM's profile run."""
    widest = max(present_values(twice_k_gate)[-1], present_values(twice_k_up)[-1])
    for stages in range(MAX_STAGES, 1, -1):
        if limit is None or gate_up_shared_bytes(widest, dot_fp16, stages) <= limit:
            return stages
    return 1


@dataclass(slots=True)
class Routing:
    """The batch's routing as the fused kernels read it: router weights and local expert ids per token (the in-kernel
    dedup reads the ids), and above the dedup range the slots sorted into blocks of one expert (row ids, each block's
    expert; unread below it)."""

    route: torch.Tensor = arg(strided("route_ptr", "*fp32", ("stride_r0", "stride_r1"), dense=True))
    ids: torch.Tensor = arg(strided("ids_ptr", "*i64", ("stride_i0", "stride_i1"), dense=True))
    row_ids: torch.Tensor = arg(pointer("row_ids_ptr", "*i32"))
    block_matrix: torch.Tensor = arg(pointer("block_matrix_ptr", "*i32"))


@dataclass(slots=True)
class SlotShape:
    """What a fused launch derives from its tensors' shapes: slots, the product's sides and K steps (runtime
    arguments); top-k, slots per program and the dedup's slot vector width (compiled in)."""

    num_slots: int = arg(derived("num_slots"))
    size_k: int = arg(derived("size_k", aligned=True))  # whole 128-wide pieces
    size_n: int = arg(derived("size_n", aligned=True))
    steps: int = arg(derived("steps"))
    top_k: int = arg(constexpr("TOP_K"))
    block_m: int = arg(constexpr("BLOCK_M"))
    slots_p2: int = arg(constexpr("SLOTS_P2"))

    @classmethod
    def of(cls, num_slots: int, size_k: int, size_n: int, routing: Routing, dedup: bool) -> SlotShape:
        top_k = routing.ids.shape[1]
        return cls(num_slots, size_k, size_n, size_k // PIECE, top_k, BLOCK_M, slots_p2(num_slots, top_k, dedup))


def _grid(args: LaunchArgs, num_slots: int, size_n: int, parts: int) -> tuple[int, int, int]:
    """(blocks of slots: one per slot with the dedup, else the sorted blocks; output piece pairs; parts)."""
    blocks = num_slots if args.dedup else args.routing.block_matrix.shape[0]
    return blocks, _pieces_grid(size_n), parts


def _launch_gate_up(args: LaunchArgs) -> None:
    parts, _, num_slots, size_n = args.partial.shape
    shape = SlotShape.of(num_slots, args.suh_gate.shape[1], size_n, args.routing, args.dedup)
    stages = gate_up_stages(args.gate.uniform_twice_k, args.up.uniform_twice_k, args.flags.dot_fp16,
                            shared_per_block(args.x.device))
    moe_gate_up_kernel[_grid(args, num_slots, size_n, parts)](
        **GATE_UP.kernel_kwargs(args, shape=shape, fill=writes_through(args.gate, args.up), finish=parts == 1),
        num_warps=MATMUL_WARPS, num_stages=stages,
    )


def _launch_down(args: LaunchArgs) -> None:
    parts, num_slots, size_n = args.out.shape
    gate_parts, size_k = args.partial.shape[0], args.partial.shape[3]
    shape = SlotShape.of(num_slots, size_k, size_n, args.routing, args.dedup)
    moe_down_kernel[_grid(args, num_slots, size_n, parts)](
        **DOWN.kernel_kwargs(args, shape=shape, gate_parts=gate_parts, fill=writes_through(args.down),
                             finished=gate_parts == 1),
        num_warps=MATMUL_WARPS,
    )


def _launch_sum(args: LaunchArgs) -> None:
    parts, num_slots, size_n = args.y.shape
    tokens, hidden = args.out.shape
    moe_sum_kernel[(tokens, triton.cdiv(hidden, SUM_BLOCK))](
        **SUM.kernel_kwargs(args, parts=parts, num_slots=num_slots, size_n=size_n, hidden=hidden,
                            top_k=args.ids.shape[1], block=SUM_BLOCK))


_SCALE = "*fp16"
GATE_UP = LaunchSpec("moe_gate_up_triton", moe_gate_up_kernel, {
    "x": INPUT_ROWS, "routing": Routing,
    "suh_gate": pointer("suh_gate_ptr", _SCALE), "suh_up": pointer("suh_up_ptr", _SCALE),
    "svh_gate": pointer("svh_gate_ptr", _SCALE), "svh_up": pointer("svh_up_ptr", _SCALE),
    "gate": MatrixArgs, "up": MatrixArgs, "partial": pointer("partial_ptr", "*fp32", "Tensor(a!)"),
    "suh_down": pointer("suh_down_ptr", _SCALE), "keep": KEEP, "swiglu_limit": SWIGLU_LIMIT,
    "dedup": constexpr("DEDUP", "bool"), "flags": Flags,
}, derived={"shape": SlotShape, "fill": constexpr("FILL"), "finish": constexpr("FINISH")})
DOWN = LaunchSpec("moe_down_triton", moe_down_kernel, {
    "partial": pointer("partial_ptr", "*fp32"), "routing": Routing, "keep": KEEP,
    "suh_down": pointer("suh_down_ptr", _SCALE), "svh_down": pointer("svh_down_ptr", _SCALE), "down": MatrixArgs,
    "out": pointer("out_ptr", "*fp32", "Tensor(a!)"), "swiglu_limit": SWIGLU_LIMIT,
    "dedup": constexpr("DEDUP", "bool"), "flags": Flags,
}, derived={"shape": SlotShape, "gate_parts": derived("gate_parts"), "fill": constexpr("FILL"),
            "finished": constexpr("FINISHED")})
SUM = LaunchSpec("moe_sum_triton", moe_sum_kernel, {
    "y": pointer("y_ptr", "*fp32"), "ids": strided("ids_ptr", "*i64", ("stride_i0", "stride_i1"), dense=True),
    "out": strided("out_ptr", ACTIVATION, ("stride_om",), "Tensor(a!)", aligned=True),  # the forward's torch.empty
}, derived={"parts": derived("parts"), "num_slots": derived("num_slots"), "size_n": derived("size_n"),
            "hidden": derived("hidden"), "top_k": constexpr("TOP_K"), "block": constexpr("BLOCK")})
_gate_up = GATE_UP.register(_launch_gate_up)
_down = DOWN.register(_launch_down)
_sum = SUM.register(_launch_sum)


def decode_split(hidden_in: int, intermediate: int, hidden_out: int, top_k: int, target: int) -> tuple[int, int]:
    """(gate/up parts, down parts): how many parts each decode kernel splits its input dimension into so that
    top_k slots' programs reach `target` (fill_target) programs."""
    return (split_for(hidden_in // PIECE, top_k * -(-intermediate // (2 * PIECE)), target),
            split_for(intermediate // PIECE, top_k * -(-hidden_out // (2 * PIECE)), target))


def workspace_shapes(tokens: int, top_k: int, split: tuple[int, int], intermediate: int,
                     hidden_out: int) -> dict[str, tuple[int, ...]]:
    """The workspace views a forward of `tokens` rows takes, by purpose (the decode's split parts up to
    DECODE_MAX_TOKENS, one part above)."""
    slots = tokens * top_k
    gate_parts, down_parts = split if tokens <= DECODE_MAX_TOKENS else (1, 1)
    return {"moe_partial": (gate_parts, 2, slots, intermediate), "moe_out": (down_parts, slots, hidden_out)}


def workspace_floats(top_k: int, capture_rows: tuple[int, ...], split: tuple[int, int], intermediate: int,
                     hidden_out: int) -> dict[str, int]:
    """Floats reserved at build, by purpose: enough for every batch up to DECODE_MAX_TOKENS and every captured
    batch size, so that no take() inside a CUDA-graph capture has to allocate (it raises there)."""
    rows = (*range(1, DECODE_MAX_TOKENS + 1), *capture_rows)
    needs = [workspace_shapes(n, top_k, split, intermediate, hidden_out) for n in rows]
    return {purpose: max(math.prod(need[purpose]) for need in needs) for purpose in needs[0]}


class FusedTritonMoE:
    """A MoE layer's routed experts through the three kernels above (see the module docstring)."""

    def __init__(self, experts: list[PlacedExpert], tables: PointerTables, scales: ScaleStacks,
                 arena: HostArena | None, crop: ExpertCrop, dtype: torch.dtype, device: torch.device,
                 swiglu_limit: float | None = None, top_k: int = 1, capture_rows: tuple[int, ...] = (),
                 split: tuple[int, int] | None = None, cache: ExpertSlots | None = None,
                 dequant_min_rows: int = DEQUANT_MIN_ROWS, dequant_workspace_bytes: int = DEQUANT_WORKSPACE_BYTES,
                 ) -> None:
        """`cache`: the GPU tier as an expert cache (kernels/expert_slots.py): each forward takes its step's fill
        tables, writes the filled experts through as the kernels read them, and switches the tables after.
        `dequant_*`: triton_prefill's threshold and workspace (tests make both small)."""
        # The tables hold only raw addresses: own what they point to (GPU-tier tensors, the host arena).
        self.experts = list(experts)
        self.arena = arena
        self.tables = {
            p: matrix_table([e.projections[p] for e in experts], tables.table(p, "trellis"), device)
            for p in PROJECTIONS
        }
        self.scales = scales
        self.num_experts = len(experts)
        self.hidden = crop.hidden
        self.swiglu_limit = swiglu_limit
        self.dot_fp16 = dtype in (torch.float16, torch.bfloat16)
        self.device = device
        intermediate = self.tables["gate"].out_features
        self.keep_channels = None  # the down kernel compiles without the crop where this rank keeps every channel
        if (crop.offset, crop.intermediate) != (0, intermediate):
            self.keep_channels = torch.zeros(intermediate, device=device)
            self.keep_channels[crop.offset : crop.offset + crop.intermediate] = 1.0
        self.no_blocks = torch.zeros(1, dtype=torch.int32, device=device)  # decode's unread row_ids/block_matrix
        self.fill: dict[str, torch.Tensor] | None = None  # write_through()
        self.cache = cache
        hidden_out = self.tables["down"].out_features
        if split is None:
            split = decode_split(self.tables["gate"].in_features, intermediate, hidden_out, top_k,
                                 fill_target(device))
        self.split = split  # (gate/up parts, down parts) at decode
        for purpose, floats in workspace_floats(top_k, capture_rows, split, intermediate, hidden_out).items():
            WORKSPACES.reserve(device, purpose, floats)
        self.prefill = DequantizedPrefill(self.tables, scales, dtype, device, self.keep_channels, swiglu_limit,
                                          dequant_min_rows, dequant_workspace_bytes)

    def write_through(self, fill: dict[str, torch.Tensor] | None) -> None:
        """From the next forward on, copy every trellis word read of expert e's projection p to the address
        fill[p][e] (int64 per expert, 0 = none; a buffer with the trellis's layout), once per forward; None stops."""
        if fill is not None:
            for p in PROJECTIONS:
                if fill[p].dtype != torch.int64 or fill[p].shape != (self.num_experts,):
                    raise InvalidValueError(f"fill[{p!r}] must be int64 ({self.num_experts},), got {fill[p].dtype} "
                                     f"{tuple(fill[p].shape)}")
        self.fill = fill

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, apply_router_weight_on_input: bool
    ) -> torch.Tensor:
        """Router-weighted sum over this rank's slice of the routed experts; topk_ids are local ids."""
        tokens, top_k = topk_ids.shape
        x, topk_weights, topk_ids = dense_rows(x), dense_rows(topk_weights), dense_rows(topk_ids)
        dedup = tokens <= DEDUP_MAX_TOKENS
        dense = not dedup and tokens >= self.prefill.min_rows  # an expert may have enough slots to be dequantized
        counts = None
        if dedup:
            row_ids = block_matrix = self.no_blocks
        else:
            counts = slot_counts(topk_ids.reshape(-1), self.num_experts)
            row_ids, block_matrix = grouped_blocks(topk_ids.reshape(-1), self.num_experts, BLOCK_M, counts)
            if dense:  # the fused kernels take the other experts' blocks
                block_matrix = blocks_where(block_matrix, counts, self.prefill.min_rows, at_least=False)
        gate, up, down = (self.tables[p] for p in PROJECTIONS)
        # The cache decides first; the launches read through the old tables and write its fills.
        fill = self.cache.begin(topk_ids) if self.cache is not None else (self.fill or {})
        shapes = workspace_shapes(tokens, top_k, self.split, gate.out_features, down.out_features)
        partial, y = (WORKSPACES.take(self.device, purpose, shape) for purpose, shape in shapes.items())
        out = torch.empty(tokens, self.hidden, dtype=x.dtype, device=x.device)
        routing = Routing(topk_weights, topk_ids, row_ids, block_matrix)
        flags = Flags(route_on_input=apply_router_weight_on_input, dot_fp16=self.dot_fp16)
        scales = self.scales
        _gate_up(x=x, routing=routing, suh_gate=scales[("gate", "suh")], suh_up=scales[("up", "suh")],
                 svh_gate=scales[("gate", "svh")], svh_up=scales[("up", "svh")],
                 gate=MatrixArgs.of(gate, fill.get("gate")), up=MatrixArgs.of(up, fill.get("up")), partial=partial,
                 suh_down=scales[("down", "suh")], keep=self.keep_channels, swiglu_limit=self.swiglu_limit,
                 dedup=dedup, flags=flags)
        _down(partial=partial, routing=routing, keep=self.keep_channels, suh_down=scales[("down", "suh")],
              svh_down=scales[("down", "svh")], down=MatrixArgs.of(down, fill.get("down")), out=y,
              swiglu_limit=self.swiglu_limit, dedup=dedup, flags=flags)
        if dense:
            self.prefill.forward(x, topk_weights, topk_ids, counts, partial, y, fill, apply_router_weight_on_input)
        if self.cache is not None:
            self.cache.finish()  # every trellis read of this forward is queued: the tables switch now
        _sum(y=y, ids=topk_ids, out=out)
        return out


def fused_moe(layer: MoELayer, split: tuple[int, int] | None = None, **prefill: int) -> FusedTritonMoE:
    """`prefill`: FusedTritonMoE's dequant_min_rows / dequant_workspace_bytes where not the defaults (tests)."""
    return FusedTritonMoE(layer.experts, layer.tables, layer.scales, layer.arena, layer.crop, layer.dtype,
                          layer.device, layer.swiglu_limit, layer.top_k, layer.capture_rows, split, layer.cache,
                          **prefill)


_TRITON_DTYPES = {"fp16": "*fp16", "bf16": "*bf16", "fp32": "*fp32"}


def _per_target(variant: Callable[[int], Any]) -> list[tuple[Any, Callable[[int], bool] | None]]:
    """(what `variant(capability)` returns, the targets launching it) over the static report's targets: one entry
    where every target launches the same, else one per target."""
    chosen = {cap: variant(cap) for cap in SHARED_PER_BLOCK}
    if all(v == next(iter(chosen.values())) for v in chosen.values()):
        return [(next(iter(chosen.values())), None)]
    return [(v, lambda capability, cap=cap: capability == cap) for cap, v in chosen.items()]


def static_kernels(shape: LayerShape) -> list[StaticKernel]:
    """What `bench-kernels --static` compiles of this module at `shape`: gate/up and down for every activation
    dtype at decode (1 token: one program per slot, the input split as each target splits it) and, for fp16, as a
    prefill's experts with few slots run them (rows sorted by expert, one part: gate/up finishes down's input), and
    the sum of the slots (which reads no trellis: its registers, spills and shared memory). Each specialised as
    Triton's JIT keys the launch (`LaunchSpec.specialised`: the declared unit strides and aligned arguments, and the
    shape's K steps, top-k row strides, widths and split); one variant per target where the targets' stages or split
    differ. (triton_prefill.py lists the dense experts' kernels.)"""
    codebook = CODEBOOK_IDS_BY_NAME[shape.codebook]
    twice_k = int(2 * shape.k_bits)
    rows = dict(stride_r0=shape.top_k, stride_i0=shape.top_k)  # dense_rows: (tokens, top_k) and (tokens, hidden)
    kernels = []
    for dtype, activation in _TRITON_DTYPES.items():
        for mode, dedup in (("decode", True), ("prefill", False)):
            if mode == "prefill" and dtype != "fp16":
                continue

            def split(capability: int) -> tuple[int, int]:
                return (decode_split(shape.hidden, shape.intermediate, shape.hidden, shape.top_k,
                                     2 * SM_COUNT[capability]) if dedup else (1, 1))

            flags = dict(TOP_K=shape.top_k, DEDUP=dedup, BLOCK_M=BLOCK_M,
                         SLOTS_P2=slots_p2(shape.top_k, shape.top_k, dedup), DOT_FP16=dtype != "fp32",
                         ROUTE_ON_INPUT=False, FILL=False, CLAMP=False, CROP=False)
            gate_up = GATE_UP.specialised(activation, dict(rows, stride_xm=shape.hidden, hidden=shape.hidden,
                                                           steps=shape.hidden // PIECE))
            for stages, launched_on in _per_target(
                    lambda cap: gate_up_stages(twice_k, twice_k, dtype != "fp32", SHARED_PER_BLOCK[cap])):
                kernels.append(StaticKernel(
                    f"moe_gate_up[{shape.codebook},{dtype},{mode}]", moe_gate_up_kernel, gate_up.signature,
                    {**flags, **gate_up.constants, "TWICE_K_GATE": twice_k, "TWICE_K_UP": twice_k,
                     "CODEBOOK_GATE": codebook, "CODEBOOK_UP": codebook, "FINISH": mode == "prefill"}, MATMUL_WARPS,
                    stages, 2 * 2 * PIECE * PIECE, dtype=dtype, trellis_arg="gate_trellis", aligned=gate_up.aligned,
                    launched_on=launched_on))
            for down, launched_on in _per_target(lambda cap: DOWN.specialised(
                    activation, dict(rows, steps=shape.intermediate // PIECE, gate_parts=split(cap)[0]))):
                kernels.append(StaticKernel(
                    f"moe_down[{shape.codebook},{dtype},{mode}]", moe_down_kernel, down.signature,
                    {**flags, **down.constants, "TWICE_K_DOWN": twice_k, "CODEBOOK_DOWN": codebook,
                     "FINISHED": mode == "prefill"}, MATMUL_WARPS, 3, 2 * PIECE * PIECE, dtype=dtype,
                    trellis_arg="down_trellis", aligned=down.aligned, launched_on=launched_on))
        total = SUM.specialised(activation, dict(stride_i0=shape.top_k, size_n=shape.hidden, hidden=shape.hidden,
                                                 stride_om=shape.hidden))
        kernels.append(StaticKernel(f"moe_sum[{dtype}]", moe_sum_kernel, total.signature,
                                    {**total.constants, "TOP_K": shape.top_k, "BLOCK": SUM_BLOCK}, 4, 3, 0,
                                    dtype=dtype, trellis_arg=None, aligned=total.aligned))
    return kernels
