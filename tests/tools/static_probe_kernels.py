"""Triton kernels whose static facts are known, for tests/tools/test_static_kernels.py (loaded by file path in the
report's compile child), listed under the StaticKernel contract:
- `probe_kernels`: tiny kernels with 32- or 16-bit trellis loads beside 8-bit activation loads, one whose loop
  carries a known number of extra instructions, one whose loop nests a loop over fp32 partials (as moe_down's), and
  a table of the dense kernel's kind (a trellis address field beside an offset into a second, fp16 array) with its
  twin whose second field is a 16-bit trellis address;
- `legacy_kernel`: the Triton matmul as it was before the ring-order decode (main at 1b7a8c5: per-weight 16-bit
  gathers of two ring units, 64-bit arithmetic), kept here verbatim as the report's known answer: issue #24 read
  16-bit trellis loads and 20/38/52 SASS instructions per weight (3INST/MUL1/mixed) from it;
- `today_mul1`: the backend's current MUL1 fp16 kernel alone.
"""

from __future__ import annotations

from dataclasses import replace

import triton
import triton.language as tl

from vllm_expert_offload.kernels import triton_exl3
from vllm_expert_offload.kernels.static_spec import LayerShape, StaticKernel

BLOCK = 128  # one weight per thread at 4 warps


@triton.jit
def _bump(x, EXTRA: tl.constexpr):
    """x + 1, done as EXTRA + 1 chained PTX adds (inline asm, so LLVM cannot fold them)."""
    if EXTRA == 0:
        return tl.inline_asm_elementwise("add.u32 $0, $1, 1;", "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .u32 t; add.u32 t, $1, 1;" + " add.u32 t, t, 0;" * EXTRA + " mov.u32 $0, t; }",
            "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def probe_kernel(table_ptr, act_ptr, out_ptr, n, flag, partial_ptr, parts, WORD_BITS: tl.constexpr,
                 EXTRA: tl.constexpr, BRANCH: tl.constexpr, NESTED: tl.constexpr, BLOCK: tl.constexpr):
    """Sums a 'trellis' read through a one-entry address table (WORD_BITS-bit loads) and 8-bit 'activations';
    BRANCH: EXTRA or EXTRA + 1 extra instructions on alternate steps (a runtime branch inside the loop body);
    NESTED: each step also sums `parts` fp32 partials in a nested loop of 14 more instructions (moe_down's kind)."""
    address = tl.load(table_ptr)
    if WORD_BITS == 32:
        trellis = address.to(tl.pointer_type(tl.int32))
    else:
        trellis = address.to(tl.pointer_type(tl.int16))
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for k in range(0, n, BLOCK):
        word = tl.load(trellis + k + offs).to(tl.int32)
        act = tl.load(act_ptr + k + offs).to(tl.int32)
        if NESTED:
            for part in range(parts):  # a runtime trip count: a loop in PTX and SASS
                act += _bump(tl.load(partial_ptr + part * n + k + offs).to(tl.int32, bitcast=True), 12)
        if BRANCH:
            if (k // BLOCK) % 2 == flag:  # varies with k: LLVM cannot hoist the branch out of the loop
                acc += _bump(word, EXTRA) * act
            else:
                acc += _bump(word, EXTRA + 1) * act
        else:
            acc += _bump(word, EXTRA) * act
    tl.store(out_ptr + offs, acc)


@triton.jit
def table_kernel(ids_ptr, table_ptr, scale_ptr, out_ptr, n, SECOND_IS_ADDRESS: tl.constexpr, BLOCK: tl.constexpr):
    """The dense kernel's table in small: entry ids[0] of a two-field int64 table holds the address of 32-bit
    trellis words and either an offset into `scale_ptr`'s fp16 array (as linear_kernel's suh_at: not trellis)
    or, SECOND_IS_ADDRESS, the address of 16-bit trellis words (so the narrowest trellis load is 16-bit)."""
    entry = table_ptr + 2 * tl.load(ids_ptr)  # an index read through another pointer, as the MoE kernels' ids
    trellis = tl.load(entry).to(tl.pointer_type(tl.int32))
    second = tl.load(entry + 1)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, n, BLOCK):
        if SECOND_IS_ADDRESS:
            scale = tl.load(second.to(tl.pointer_type(tl.float16)) + k + offs)
        else:
            scale = tl.load(scale_ptr + second + k + offs)
        acc += tl.load(trellis + k + offs).to(tl.float32, bitcast=True) * scale.to(tl.float32)
    tl.store(out_ptr + offs, acc)


@triton.jit
def strided_kernel(trellis_ptr, out_ptr, n, stride, BLOCK: tl.constexpr):
    """Sums rows of 16-bit 'trellis' words `stride` apart, 8 contiguous words per thread: Triton reads them with one
    128-bit load only where the pointer and the stride are known to be aligned to 16 (what its launch specialises
    on), else with 16-bit loads."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for k in range(0, n):
        acc += tl.load(trellis_ptr + k * stride + offs).to(tl.int32)
    tl.store(out_ptr + offs, acc)


@triton.jit
def _legacy_lop3_halves(x):
    """3INST/MCG: keep sign, low exponent bits and mantissa of both halves, force the exponent to 011xx,
    add the two fp16 halves in fp32 (exact) and round once, which equals __hadd."""
    x = (x & 0x8FFF8FFF) ^ 0x3B603B60
    lo = (x & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
    hi = (x >> 16).to(tl.uint16).to(tl.float16, bitcast=True)
    return (lo.to(tl.float32) + hi.to(tl.float32)).to(tl.float16)


@triton.jit
def _legacy_codebook_value(state, codebook):
    """16-bit state (int64) -> fp16 weight. `codebook` may be a constexpr or a runtime scalar."""
    inst3 = _legacy_lop3_halves((state * 89226354 + 64248484) & 0xFFFFFFFF)
    mcg = _legacy_lop3_halves((state * 0xCBAC1FED) & 0xFFFFFFFF)
    x = (state * 0x83DCD12D) & 0xFFFFFFFF
    bytesum = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + ((x >> 24) & 0xFF)
    # __hfma(1024 + bs, fp16(0x1EEE), fp16(0xC931)): an integer numerator below 2^20, exact in fp32.
    mul1 = (((1024 + bytesum) * 1774 - 2721792).to(tl.float32) * 3.814697265625e-06).to(tl.float16)
    return tl.where(codebook == 0, inst3, tl.where(codebook == 1, mcg, mul1))


@triton.jit
def _legacy_ring_units(offs_k, offs_n, k_int, k_half):
    """For each (row, column) of a block: the two 16-bit stream units its state window spans (already
    swapped to storage order) and the right shift that aligns the window. Independent of the block's
    position, because every block starts on a tile boundary."""
    r = (offs_k % 16)[:, None]
    c = (offs_n % 16)[None, :]
    t = 4 * (c % 8) + (r % 8) // 2
    j = (r % 2) + 2 * (r // 8) + 4 * (c // 8)
    p = 8 * t + j
    units = 16 * k_int + 8 * k_half  # int16 per tile = 16 K
    ring = 16 * units
    start = (p + 1) * k_int + k_half * ((p + 1) // 2) - 16
    start = tl.where(start < 0, start + ring, start)
    first = start // 16
    second = tl.where(first + 1 == units, 0, first + 1)
    return first ^ 1, second ^ 1, 16 - start % 16


@triton.jit
def legacy_decode_block(trellis, k0, n0, size_n, twice_k, codebook, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """fp16 (BLOCK_K, BLOCK_N): W_hat[k0:k0+BLOCK_K, n0:n0+BLOCK_N] of the matrix whose trellis is at `trellis`."""
    k_int = twice_k // 2
    k_half = twice_k % 2
    units = 16 * k_int + 8 * k_half  # int16 per tile = 16 K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    first, second, shift = _legacy_ring_units(tl.arange(0, BLOCK_K), offs_n, k_int, k_half)
    base = trellis.to(tl.pointer_type(tl.int16))
    tile = ((offs_k // 16)[:, None] * (size_n // 16) + (offs_n // 16)[None, :]).to(tl.int64) * units
    hi = tl.load(base + tile + first).to(tl.int64) & 0xFFFF
    lo = tl.load(base + tile + second).to(tl.int64) & 0xFFFF
    state = (((hi << 16) | lo) >> shift) & 0xFFFF
    return _legacy_codebook_value(state, codebook)


@triton.jit
def legacy_matmul_kernel(
    a_ptr, stride_am, c_ptr, stride_cm, row_ids_ptr, block_matrix_ptr, trellis_table_ptr, twice_k_table_ptr,
    codebook_table_ptr, size_k, size_n,
    CODEBOOK: tl.constexpr, DOT_FP16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    matrix = tl.load(block_matrix_ptr + block)
    if matrix >= 0:
        rows = tl.load(row_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = rows >= 0
        trellis = tl.load(trellis_table_ptr + matrix)
        twice_k = tl.load(twice_k_table_ptr + matrix)
        if CODEBOOK == -1:
            codebook = tl.load(codebook_table_ptr + matrix)
        else:
            codebook = CODEBOOK
        n0 = tl.program_id(1) * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_kb = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, size_k, BLOCK_K):
            offs_k = k0 + offs_kb
            a = tl.load(a_ptr + rows[:, None] * stride_am + offs_k[None, :], mask=row_ok[:, None], other=0.0)
            w = legacy_decode_block(trellis, k0, n0, size_n, twice_k, codebook, BLOCK_K, BLOCK_N)
            if DOT_FP16:
                acc += tl.dot(a.to(tl.float16), w)
            else:
                acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        tl.store(c_ptr + rows[:, None] * stride_cm + offs_n[None, :], acc, mask=row_ok[:, None])


def legacy_kernel(shape: LayerShape) -> list[StaticKernel]:
    """The former kernel's MUL1 fp16 variant, as the backend launched it."""
    (today,) = today_mul1(shape)
    constexprs = {k: v for k, v in today.constexprs.items() if k != "TWICE_K"}
    return [replace(today, name="legacy[mul1,fp16]", fn=legacy_matmul_kernel, constexprs=constexprs)]


def _probe(word_bits: int, extra: int, branch: bool = False, nested: bool = False) -> StaticKernel:
    return StaticKernel(
        name=f"probe[{word_bits},{extra}{',branch' if branch else ''}{',nested' if nested else ''}]", fn=probe_kernel,
        signature={"table_ptr": "*i64", "act_ptr": "*i8", "out_ptr": "*i32", "n": "i32", "flag": "i32",
                   "partial_ptr": "*fp32", "parts": "i32"},
        constexprs={"WORD_BITS": word_bits, "EXTRA": extra, "BRANCH": branch, "NESTED": nested, "BLOCK": BLOCK},
        num_warps=4, num_stages=1, weights_per_iteration=BLOCK, trellis_arg="table_ptr",
    )


def _table(second_is_address: bool) -> StaticKernel:
    return StaticKernel(
        name=f"table[{'address' if second_is_address else 'offset'}]", fn=table_kernel,
        signature={"ids_ptr": "*i64", "table_ptr": "*i64", "scale_ptr": "*fp16", "out_ptr": "*fp32", "n": "i32"},
        constexprs={"SECOND_IS_ADDRESS": second_is_address, "BLOCK": BLOCK},
        num_warps=4, num_stages=1, weights_per_iteration=BLOCK, trellis_arg="table_ptr",
    )


def _strided(aligned: tuple[str, ...]) -> StaticKernel:
    return StaticKernel(
        name=f"strided[{','.join(aligned)}]", fn=strided_kernel,
        signature={"trellis_ptr": "*i16", "out_ptr": "*i32", "n": "i32", "stride": "i32"},
        constexprs={"BLOCK": 8 * 128}, num_warps=4, num_stages=1, weights_per_iteration=8 * 128,
        trellis_arg="trellis_ptr", trellis_indirection=0, aligned=aligned,
    )


def _launched_on_sm_120(capability: int) -> bool:
    return capability == 120


def probe_kernels(shape: LayerShape) -> list[StaticKernel]:
    sm_120_only = replace(_strided(()), name="strided[sm_120 only]", launched_on=_launched_on_sm_120)
    return [_probe(32, 0), _probe(16, 0), _probe(32, 10), _probe(32, 10, branch=True), _probe(32, 10, nested=True),
            _table(False), _table(True), _strided(()), _strided(("trellis_ptr",)),
            _strided(("trellis_ptr", "stride")), sm_120_only] + legacy_kernel(shape)


def today_mul1(shape: LayerShape) -> list[StaticKernel]:
    """The Triton backend's MUL1 fp16 kernel alone (one compile per target keeps the test short)."""
    return [k for k in triton_exl3.static_kernels(shape) if k.name == "exl3_matmul[mul1,fp16]"]
