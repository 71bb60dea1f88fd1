"""A dense EXL3 linear (every shard of one vLLM layer) in one Triton launch, or two when its input is split; from
`DEQUANT_MIN_ROWS` rows on (a prefill), each shard decoded once into a workspace and multiplied by torch's matmul.

The layer's output is the concatenation, per shard, of this rank's part of the shard's 128-aligned cover,
followed by zero padding rows (a padded vocabulary); the shards' covers are cut into 256-wide output pairs of
128-wide pieces (the last one of a cover may be alone), listed at load in one small int64 table (`PIECE_FIELDS`
per pair). A program takes BLOCK_M rows and one pair: the input at the shard's offset inside its cover, ⊙ suh and
rotated in-kernel once per step for both pieces, multiplied by each decoded piece of W_hat
(`triton_decode.decode_block`) over the 128-wide input pieces of its part, each rotated back ⊙ svh.
- one part (`linear_kernel` alone): the program stores the cropped piece straight into the output, cast to the
  model's dtype; the program of a shard's first piece also zeroes the shard's padding rows;
- several parts (decode, so that the grid fills the GPU at batch 1; `triton_fused.split_for`): each part stores
  its fp32 partial (rotation and svh are linear), and `linear_finish_kernel` sums the parts in order
  (deterministic), crops, pads and casts;
- from `DEQUANT_MIN_ROWS` rows: per shard, chunks of its covered columns decoded with the input rotation folded in,
  W' = H · W_hat (`triton_dequantize.dequantize`); the rank's input ⊙ suh / √128 (once per shard) times each chunk
  by torch's matmul (cuBLAS on a GPU), rotated back ⊙ svh by torch, its valid columns written into the output;
  padding zeroed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..exl3.hadamard import hadamard_128, hadamard_last
from .contract import LinearLayer
from .launch_spec import ACTIVATION, Arg, LaunchArgs, LaunchSpec, constexpr, pointer, strided
from .linear import LinearShard
from .matrix_table import CODEBOOK_IDS, CODEBOOK_IDS_BY_NAME, matrix_table, own_addresses, present_key
from .static_spec import LayerShape, StaticKernel
from .triton_decode import matrix_rate
from .triton_dequantize import DEQUANT_MIN_ROWS, DEQUANT_WORKSPACE_BYTES, dequantize
from .triton_fused import (HALF, MATMUL_WARPS, PIECE, WORKSPACES, fill_target, hadamard_signs, load_row_halves,
                           load_vector_halves, rotate, rotated_pieces, split_for)

PIECE_FIELDS = ("trellis", "twice_k", "codebook", "size_k", "size_n", "n0", "in_offset", "in_size", "suh", "svh",
                "out_shift", "out_lo", "out_hi", "pad_lo", "pad_hi", "partial_col")
FINISH_BLOCK = 256
BLOCK_M = 16  # rows per program, below the dequantize threshold (triton_dequantize.DEQUANT_MIN_ROWS)


@triton.jit
def linear_kernel(
    x_ptr, stride_xm, rows, pieces_ptr, suh_ptr, svh_ptr, out_ptr, stride_om, partial_ptr, partial_cols,
    TWICE_K: tl.constexpr, CODEBOOK: tl.constexpr, DOT_FP16: tl.constexpr, BLOCK_M: tl.constexpr,
    DIRECT: tl.constexpr,
):
    """One (BLOCK_M rows, 256-wide output pair, part of the input) product; see the module docstring."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < rows
    piece = pieces_ptr + tl.program_id(1) * 16
    trellis = tl.load(piece + 0)
    twice_k, codebook = matrix_rate(piece + 1, piece + 2, TWICE_K, CODEBOOK)
    size_k = tl.load(piece + 3)
    size_n = tl.load(piece + 4)
    n0 = tl.load(piece + 5)
    second = n0 + 128 < size_n  # the pair's second piece exists
    in_offset = tl.load(piece + 6)
    in_size = tl.load(piece + 7)
    suh_at = tl.load(piece + 8)
    part = tl.program_id(2)
    parts = tl.num_programs(2)
    steps = size_k // 128
    per_part = (steps + parts - 1) // parts
    signs = hadamard_signs(HALF)
    acc = tl.zeros((BLOCK_M, 128), dtype=tl.float32)
    acc_second = tl.zeros((BLOCK_M, 128), dtype=tl.float32)
    x_rows = x_ptr + offs_m[:, None] * stride_xm - in_offset  # cover column c reads input column c - in_offset
    for step in range(part * per_part, tl.minimum(steps, (part + 1) * per_part)):
        k0 = step * 128
        a_lo, a_hi = load_row_halves(x_rows, row_ok, k0, in_offset + in_size, in_offset)
        suh_lo, suh_hi = load_vector_halves(suh_ptr + suh_at, k0)
        acc, acc_second = rotated_pieces(acc, acc_second, a_lo * suh_lo, a_hi * suh_hi, signs, trellis, k0, n0, size_n,
                                         twice_k, codebook, second, TWICE_K, CODEBOOK, DOT_FP16)
    signs = hadamard_signs(128)
    _store_piece(out_ptr, stride_om, partial_ptr, partial_cols, rows, offs_m, row_ok, piece, part, n0, acc,
                 signs, svh_ptr, DOT_FP16, DIRECT)
    if second:
        _store_piece(out_ptr, stride_om, partial_ptr, partial_cols, rows, offs_m, row_ok, piece, part, n0 + 128,
                     acc_second, signs, svh_ptr, DOT_FP16, DIRECT)
    if DIRECT and n0 == 0:  # the shard's zero padding rows
        offs = tl.arange(0, 128)
        pad_lo = tl.load(piece + 13)
        pad_hi = tl.load(piece + 14)
        zeros = tl.zeros((BLOCK_M, 128), dtype=out_ptr.dtype.element_ty)
        for col in range(pad_lo, pad_hi, 128):
            pad = col + offs
            tl.store(out_ptr + offs_m[:, None] * stride_om + pad[None, :], zeros,
                     mask=row_ok[:, None] & (pad < pad_hi)[None, :])


@triton.jit
def _store_piece(out_ptr, stride_om, partial_ptr, partial_cols, rows, offs_m, row_ok, piece, part, n0, acc, signs,
                 svh_ptr, DOT_FP16: tl.constexpr, DIRECT: tl.constexpr):
    """had(acc) ⊙ svh for the cover columns n0..n0+127: straight into the output, cropped to this rank's rows and
    cast (one part), or as this part's fp32 partial."""
    offs = tl.arange(0, 128)
    svh = tl.load(svh_ptr + tl.load(piece + 9) + n0 + offs).to(tl.float32)
    y = rotate(acc, signs, DOT_FP16) * svh[None, :]
    cover = n0 + offs
    if DIRECT:
        keep = (cover >= tl.load(piece + 11)) & (cover < tl.load(piece + 12))
        out_col = cover + tl.load(piece + 10)
        tl.store(out_ptr + offs_m[:, None] * stride_om + out_col[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & keep[None, :])
    else:
        column = tl.load(piece + 15) + cover
        tl.store(partial_ptr + (part * rows + offs_m[:, None]) * partial_cols + column[None, :], y,
                 mask=row_ok[:, None])


@triton.jit
def linear_finish_kernel(partial_ptr, parts, rows, partial_cols, source_ptr, out_ptr, stride_om, out_features,
                         BLOCK: tl.constexpr):
    """out[r, o] = Σ_part partial[part, r, source[o]] in order (0 where source[o] is -1: padding), cast."""
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < out_features
    source = tl.load(source_ptr + offs, mask=ok, other=-1)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for part in range(parts):
        acc += tl.load(partial_ptr + (part * rows + row) * partial_cols + source, mask=source >= 0, other=0.0)
    tl.store(out_ptr + row * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _launch_linear(args: LaunchArgs) -> None:
    parts = args.partial.shape[0]
    linear_kernel[(triton.cdiv(args.x.shape[0], args.block_m), args.pieces.shape[0], parts)](
        **LINEAR.kernel_kwargs(args, direct=parts == 1), num_warps=MATMUL_WARPS)


def _launch_finish(args: LaunchArgs) -> None:
    rows, out_features = args.partial.shape[1], args.out.shape[1]
    linear_finish_kernel[(rows, triton.cdiv(out_features, FINISH_BLOCK))](
        **FINISH.kernel_kwargs(args, block=FINISH_BLOCK))


_OUT = strided("out_ptr", ACTIVATION, ("stride_om",), "Tensor(a!)")
LINEAR = LaunchSpec("linear_triton", linear_kernel, {
    "x": Arg("Tensor", {"x_ptr": ACTIVATION, "stride_xm": "i32", "rows": "i32"},
             expand=lambda x, _: (x, x.stride(0), x.shape[0])),
    "pieces": pointer("pieces_ptr", "*i64"), "suh": pointer("suh_ptr", "*fp16"), "svh": pointer("svh_ptr", "*fp16"),
    "out": _OUT,
    "partial": Arg("Tensor(b!)", {"partial_ptr": "*fp32", "partial_cols": "i32"},
                   expand=lambda partial, _: (partial, partial.shape[2])),
    "twice_k": constexpr("TWICE_K", "int"), "codebook": constexpr("CODEBOOK", "int"),
    "block_m": constexpr("BLOCK_M", "int"), "dot_fp16": constexpr("DOT_FP16", "bool"),
}, derived={"direct": constexpr("DIRECT")})
FINISH = LaunchSpec("linear_finish_triton", linear_finish_kernel, {
    "partial": Arg("Tensor", {"partial_ptr": "*fp32", "parts": "i32", "rows": "i32", "partial_cols": "i32"},
                   expand=lambda partial, _: (partial, *partial.shape)),
    "source": pointer("source_ptr", "*i32"),
    "out": Arg("Tensor(a!)", {"out_ptr": ACTIVATION, "stride_om": "i32", "out_features": "i32"},
               expand=lambda out, _: (out, out.stride(0), out.shape[1])),
}, derived={"block": constexpr("BLOCK")})
_linear = LINEAR.register(_launch_linear)
_finish = FINISH.register(_launch_finish)


def _piece_table(shards: Sequence[LinearShard]) -> tuple[list[list[int]], list[int]]:
    """(one PIECE_FIELDS row per pair of 128-wide pieces of every cover, the partial column of each output column or
    -1)."""
    pieces, source = [], []
    suh_at = svh_at = out_base = partial_base = 0
    for shard in shards:
        layer = shard.layer
        fields = dict(trellis=layer.trellis.data_ptr(), twice_k=int(2 * layer.k), codebook=CODEBOOK_IDS[layer.codebook],
                      size_k=layer.in_features, size_n=layer.out_features, in_offset=shard.in_offset,
                      in_size=shard.in_size, suh=suh_at, svh=svh_at, out_shift=out_base - shard.out_offset,
                      out_lo=shard.out_offset, out_hi=shard.out_offset + shard.out_valid,
                      pad_lo=out_base + shard.out_valid, pad_hi=out_base + shard.out_rows)
        for n0 in range(0, layer.out_features, 2 * PIECE):  # a program's pair of pieces
            pieces.append([{**fields, "n0": n0, "partial_col": partial_base}[name] for name in PIECE_FIELDS])
        source += [partial_base + shard.out_offset + i for i in range(shard.out_valid)]
        source += [-1] * (shard.out_rows - shard.out_valid)
        suh_at += layer.in_features
        svh_at += layer.out_features
        out_base += shard.out_rows
        partial_base += layer.out_features
    return pieces, source


# Its own buffer, not triton_dequantize.WORKSPACE: vLLM runs shared experts on aux_stream() for <= 256 tokens,
# concurrently with the routed experts' DequantizedPrefill; one shared buffer would be written by both (issue 38-3).
LINEAR_WORKSPACE = "linear_dequantized"

class FusedTritonLinear:
    """Dense shards through `linear_kernel` (and `linear_finish_kernel` when the input is split)."""

    def __init__(self, shards: Sequence[LinearShard], dtype: torch.dtype, device: torch.device,
                 capture_rows: tuple[int, ...] = (), split: int | None = None,
                 dequant_min_rows: int = DEQUANT_MIN_ROWS, dequant_workspace_bytes: int = DEQUANT_WORKSPACE_BYTES,
                 ) -> None:
        """`dequant_*`: from how many rows the shards are decoded once per forward into a workspace of at most
        that many bytes (in chunks of 128-wide columns) and multiplied by torch's matmul (tests make both small)."""
        hadamard_128(dtype, device)  # cached now: the prefill path's rotation must not copy it inside a graph
        self.shards = [shard.to(device) for shard in shards]  # owned: the piece table holds their addresses
        pieces, source = _piece_table(self.shards)
        self.pieces = torch.tensor(pieces, dtype=torch.int64, device=device)
        self.source = torch.tensor(source, dtype=torch.int32, device=device)
        self.suh = torch.cat([s.layer.suh for s in self.shards]).to(device)
        self.svh = torch.cat([s.layer.svh for s in self.shards]).to(device)
        self.codebook = present_key(CODEBOOK_IDS[s.layer.codebook] for s in self.shards)
        self.twice_k = present_key(int(2 * s.layer.k) for s in self.shards)
        self.out_features = len(source)
        self.partial_cols = sum(s.layer.out_features for s in self.shards)
        self.dot_fp16 = dtype in (torch.float16, torch.bfloat16)
        self.device = device
        steps = max(s.layer.in_features for s in self.shards) // PIECE
        self.split = split or split_for(steps, len(pieces), fill_target(device))  # at up to BLOCK_M rows
        self.no_partial = torch.zeros(1, 1, 1, device=device)  # what the one-part launch is handed, unread
        if self.split > 1:
            WORKSPACES.reserve(device, "linear_partial", self.split * BLOCK_M * self.partial_cols)
        self.dequant_min_rows = dequant_min_rows
        self.dense_tables = [matrix_table([s.layer], own_addresses([s.layer]), device) for s in self.shards]
        # the fold's input scale, suh / √128 over the shard's input range (fp32: the input is scaled, then rounded)
        self.input_scales = [(s.layer.suh.float() * PIECE**-0.5)[s.in_offset : s.in_offset + s.in_size].to(device)
                             for s in self.shards]
        self.every_row = torch.ones(1, dtype=torch.int64, device=device)  # a dense linear's one matrix always qualifies
        itemsize = dtype.itemsize
        self.chunk_columns = [max(PIECE, dequant_workspace_bytes // (s.layer.in_features * itemsize) // PIECE * PIECE)
                              for s in self.shards]
        self.workspace_elements = max(s.layer.in_features * min(s.layer.out_features, columns)
                                      for s, columns in zip(self.shards, self.chunk_columns))
        WORKSPACES.reserve(device, LINEAR_WORKSPACE, -(-self.workspace_elements * itemsize // 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W of every shard, concatenated, without bias."""
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        count = rows.shape[0]
        parts = self.split if count <= BLOCK_M else 1
        out = torch.empty(count, self.out_features, dtype=x.dtype, device=x.device)
        if count >= self.dequant_min_rows:
            self._dequantized(rows, out)
            return out.reshape(*x.shape[:-1], self.out_features)
        if parts == 1:
            partial = self.no_partial
        else:
            partial = WORKSPACES.take(self.device, "linear_partial", (parts, count, self.partial_cols))
        _linear(x=rows, pieces=self.pieces, suh=self.suh, svh=self.svh, out=out, partial=partial,
                twice_k=self.twice_k, codebook=self.codebook, block_m=BLOCK_M, dot_fp16=self.dot_fp16)
        if parts > 1:
            _finish(partial=partial, source=self.source, out=out)
        return out.reshape(*x.shape[:-1], self.out_features)

    def _dequantized(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        """out = had((rows ⊙ suh / √128) @ W') ⊙ svh per shard: each shard decoded with its input rotation folded
        in (`dequantize`), in chunks of its covered columns that fit the workspace; each chunk multiplied by torch's
        matmul, rotated back (`hadamard_last`), ⊙ svh, and its valid columns written into the output; padding rows
        zeroed."""
        w = WORKSPACES.take(self.device, LINEAR_WORKSPACE, (-(-self.workspace_elements * rows.element_size() // 4),))
        w = w.view(rows.dtype)
        base = 0
        for shard, table, chunk, scale in zip(self.shards, self.dense_tables, self.chunk_columns, self.input_scales):
            layer = shard.layer
            lo, hi = shard.out_offset, shard.out_offset + shard.out_valid
            inputs = slice(shard.in_offset, shard.in_offset + shard.in_size)
            scaled = (rows * scale).to(rows.dtype)
            for c0 in range(lo // PIECE * PIECE, hi, chunk):
                columns = min(chunk, -(-hi // PIECE) * PIECE - c0)
                dequantize(table, w, counts=self.every_row, min_rows=1, fold=True, n_first=c0, columns=columns)
                decoded = w[: layer.in_features * columns].view(layer.in_features, columns)
                y = hadamard_last(scaled @ decoded[inputs]) * layer.svh[c0 : c0 + columns]
                a, b = max(c0, lo), min(c0 + columns, hi)
                out[:, base + a - lo : base + b - lo] = y[:, a - c0 : b - c0]
            if shard.out_rows > shard.out_valid:
                out[:, base + shard.out_valid : base + shard.out_rows] = 0
            base += shard.out_rows


def fused_linear(layer: LinearLayer) -> FusedTritonLinear:
    return FusedTritonLinear(layer.shards, layer.dtype, layer.device, layer.capture_rows)


def static_kernels(shape: LayerShape) -> list[StaticKernel]:
    """What `bench-kernels --static` compiles of this module: `linear_kernel` for every activation dtype, writing
    the output directly (one part) and writing split partials (batch 1 on a GPU), at `shape`'s K and codebook. (The
    finish kernel reads no trellis; from `DEQUANT_MIN_ROWS` rows on triton_dequantize.py's kernel decodes.)"""
    variants = [(dtype, mode) for dtype in ("fp16", "bf16", "fp32") for mode in ("direct", "split")]
    return [
        StaticKernel(
            f"linear[{shape.codebook},{dtype},{mode}]", linear_kernel,
            LINEAR.signature(f"*{dtype}"),
            {"TWICE_K": int(2 * shape.k_bits), "CODEBOOK": CODEBOOK_IDS_BY_NAME[shape.codebook],
             "DOT_FP16": dtype != "fp32", "BLOCK_M": BLOCK_M, "DIRECT": mode != "split"},
            MATMUL_WARPS, 3, 2 * PIECE * PIECE, dtype=dtype, trellis_arg="pieces_ptr",
        )
        for dtype, mode in variants
    ]
