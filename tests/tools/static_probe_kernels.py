"""Tiny Triton kernels whose static facts are known, for tests/tools/test_static_kernels.py (loaded by file path in
the report's compile child). `probe_kernels(shape)` lists them under the StaticKernel contract."""

from __future__ import annotations

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
def probe_kernel(table_ptr, act_ptr, out_ptr, n, WORD_BITS: tl.constexpr, EXTRA: tl.constexpr, BLOCK: tl.constexpr):
    """Sums a 'trellis' read through a one-entry address table (WORD_BITS-bit loads) and 8-bit 'activations'."""
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
        acc += _bump(word, EXTRA) * act
    tl.store(out_ptr + offs, acc)


def _probe(word_bits: int, extra: int) -> StaticKernel:
    return StaticKernel(
        name=f"probe[{word_bits},{extra}]", fn=probe_kernel,
        signature={"table_ptr": "*i64", "act_ptr": "*i8", "out_ptr": "*i32", "n": "i32"},
        constexprs={"WORD_BITS": word_bits, "EXTRA": extra, "BLOCK": BLOCK},
        num_warps=4, num_stages=1, weights_per_iteration=BLOCK, trellis_arg="table_ptr",
    )


def probe_kernels(shape: LayerShape) -> list[StaticKernel]:
    return [_probe(32, 0), _probe(16, 0), _probe(32, 10)]


def today_mul1(shape: LayerShape) -> list[StaticKernel]:
    """The Triton backend's MUL1 fp16 kernel alone (one compile per target keeps the test short)."""
    return [k for k in triton_exl3.static_kernels(shape) if k.name == "exl3_matmul[mul1,fp16]"]
