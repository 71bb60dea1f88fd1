"""Pieces the fused Triton EXL3 kernels share (triton_moe.py, triton_linear.py): in-kernel Hadamard rotations,
the split of the input dimension, the write-through copy of trellis tiles, and the per-device workspaces.

Every fused kernel works on 128 x 128 pieces of W_hat: 128 is EXL3's Hadamard block (exl3-format.md §2.1), so
a program that holds a 128-wide piece of an input row can rotate it itself, `had(a ⊙ s) = (a ⊙ s) @ H` with
H the normalised 128 x 128 Sylvester matrix (a small device tensor made once per device), and a program that
holds a 128-wide piece of an output row can rotate that back. The rotations are fp32 products (exact inputs,
fp32 sums), as the torch glue computed them; a half-precision model's rotated input is then rounded to fp16 for
the tensor-core product with the decoded weights, as exllamav3 rounds it.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from ..exl3.hadamard import HADAMARD_BLOCK, hadamard_128
from .triton_decode import decode_block

PIECE = HADAMARD_BLOCK  # BLOCK_K = BLOCK_N of every fused kernel
MATMUL_WARPS = 8  # 256 threads per (BLOCK_M, 128) x (128, 128) piece product: 64 decoded weights per thread and piece


def hadamard(device: torch.device) -> torch.Tensor:
    """H (128, 128) fp32 on `device`, cached: a forward never copies it (a CUDA graph could not)."""
    return hadamard_128(torch.float32, device)


@triton.jit
def load_hadamard(had_ptr):
    offs = tl.arange(0, 128)
    return tl.load(had_ptr + offs[:, None] * 128 + offs[None, :])


@triton.jit
def load_hadamard_half(had_ptr, half):
    """Columns 64·half .. 64·half + 63 of H: (128, 64)."""
    return tl.load(had_ptr + tl.arange(0, 128)[:, None] * 128 + 64 * half + tl.arange(0, 64)[None, :])


@triton.jit
def product(acc, a, w, DOT_FP16: tl.constexpr):
    """acc + a @ w: fp16 tensor-core product for half-precision models, exact fp32 otherwise."""
    if DOT_FP16:
        acc += tl.dot(a.to(tl.float16), w)
    else:
        acc += tl.dot(a, w.to(tl.float32), input_precision="ieee")
    return acc


@triton.jit
def rotated_product(acc, a, scale, had_lo, had_hi, trellis, k0, n0, size_n, twice_k, codebook, DOT_FP16: tl.constexpr):
    """acc + had(a ⊙ scale) @ W_hat[k0:+128, n0:+128] for one 128-wide input piece a (M, 128) fp32.

    Computed as two 64-row halves of the piece (rotated input columns 0-63 against weight rows k0..k0+63, then
    the rest), so one decode holds 64 x 128 weights: half the registers of a whole piece."""
    scaled = a * scale[None, :]
    w = decode_block(trellis, k0, n0, size_n, twice_k, codebook, 64, 128)
    acc = product(acc, tl.dot(scaled, had_lo, input_precision="ieee"), w, DOT_FP16)
    w = decode_block(trellis, k0 + 64, n0, size_n, twice_k, codebook, 64, 128)
    return product(acc, tl.dot(scaled, had_hi, input_precision="ieee"), w, DOT_FP16)


@triton.jit
def write_through(trellis, fill, k0, n0, size_n, twice_k):
    """Copy the trellis words of the (128, 128) piece at (k0, n0) from `trellis` to `fill` (same layout).

    A piece is 8 x 8 tiles; each of its 8 tile rows is 8 consecutive tiles of 16·K int16 (an even count, so
    whole 32-bit words), copied as int32 words."""
    units = 8 * twice_k  # int16 per tile = 16 K
    words = 4 * units  # int32 per tile row of the piece: 8 tiles x units / 2
    src = trellis.to(tl.pointer_type(tl.int32))
    dst = fill.to(tl.pointer_type(tl.int32))
    offs = tl.arange(0, 512)  # the widest tile row: K = 8
    for tile_row in range(8):
        first = (((k0 // 16 + tile_row) * (size_n // 16) + n0 // 16) * units // 2).to(tl.int64)
        ok = offs < words
        tl.store(dst + first + offs, tl.load(src + first + offs, mask=ok), mask=ok)


def split_for(steps: int, programs: int, target: int) -> int:
    """How many parts to split `steps` K-steps into so that `programs` x parts reaches `target` programs: the
    smallest divisor of `steps` that does, else `steps` itself (one step per program)."""
    for parts in range(1, steps + 1):
        if steps % parts == 0 and programs * parts >= target:
            return parts
    return steps


def fill_target(device: torch.device) -> int:
    """Programs a launch should have to fill the device: its SM count on CUDA (twice, so each SM has a second
    block to hide latency with); 1 elsewhere (the interpreter runs programs one at a time)."""
    if device.type != "cuda":
        return 1
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


class Workspaces:
    """Scratch tensors of the fused kernels, one fp32 buffer per (device, purpose), shared by every layer.

    Layers run one after the other on one stream, so one buffer per purpose serves all of them. Each layer
    reserves, when it is built, what its largest graph-captured batch needs (`reserve`); a forward takes a view
    of the buffer (`take`: a view, no allocation, no kernel). A batch larger than anything reserved (a prefill
    beyond vLLM's largest captured size, which vLLM never captures) gets a fresh tensor from torch's caching
    allocator instead, refused while a CUDA graph is being captured."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}

    def reserve(self, device: torch.device, purpose: str, numel: int) -> None:
        key = (str(device), purpose)
        held = self._buffers.get(key)
        if held is None or held.numel() < numel:
            self._buffers[key] = torch.empty(numel, dtype=torch.float32, device=device)

    def take(self, device: torch.device, purpose: str, shape: tuple[int, ...]) -> torch.Tensor:
        numel = 1
        for size in shape:
            numel *= size
        held = self._buffers.get((str(device), purpose))
        if held is not None and held.numel() >= numel:
            return held[:numel].view(shape)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"fused Triton workspace {purpose!r}: a captured batch needs {numel} floats, "
                               f"{0 if held is None else held.numel()} were reserved when the layer was built")
        return torch.empty(shape, dtype=torch.float32, device=device)


WORKSPACES = Workspaces()

