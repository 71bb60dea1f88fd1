"""Per-slot offsets are 64-bit (issue #38 item 7): a prefill of ~37k tokens at top-8 and hidden 7168 holds more than
2^31 floats of per-slot output, so an int32 `slot * width` wraps. Under TRITON_INTERPRET=1 (which wraps int32 as a
GPU does) on sparse memory: the buffers are mappings of tens of GiB of address space that only the rows a test
writes ever occupy, and the widths are chosen so that a wrapped offset lands on a small row inside the same mapping
(the test reads the wrong row instead of crashing)."""

from __future__ import annotations

import mmap

import pytest
import torch

from vllm_expert_offload.kernels import triton_moe, triton_prefill
from vllm_expert_offload.kernels.triton_moe_steps import Flags, MatrixArgs

from support.moe_layers import FULL, INTERMEDIATE, placed_moe

NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value; Python 3.11 does not name it


def sparse_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Zeros over an anonymous mapping without reserved memory: pages exist once written (or read)."""
    count = 1
    for size in shape:
        count *= size
    nbytes = count * dtype.itemsize
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | NORESERVE)
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)


def test_sum_reads_slots_past_two_to_the_31_floats() -> None:
    """Rows 2^31 - 256 floats apart: row 2 starts at float 2^32 - 512, which int32 wraps to -512, inside the mapping
    just before y."""
    width, lead = 2**31 - 256, 512
    flat = sparse_zeros((lead + 3 * width,), torch.float32)
    y = flat[lead:].view(1, 3, width)
    y[0, 2, :256] = torch.arange(1, 257, dtype=torch.float32)
    flat[:256] = -7.0  # where the wrapped offset reads
    out = torch.full((3, 256), float("nan"))
    triton_moe._sum(y=y, ids=torch.zeros((3, 1), dtype=torch.int64), out=out)
    assert torch.equal(out[2], torch.arange(1, 257, dtype=torch.float32))
    assert (out[:2] == 0).all()


@pytest.fixture(scope="module")
def fused():
    return placed_moe(FULL, lambda layer: triton_moe.fused_moe(layer, (1, 1)))[1]


def _block(row: int, rows: int) -> torch.Tensor:
    row_ids = torch.full((rows,), -1, dtype=torch.int32)
    row_ids[0] = row
    return row_ids


def _route(row: int, slots: int) -> torch.Tensor:
    route = sparse_zeros((slots, 1), torch.float32)
    route[row] = 0.75
    return route


def _fused_down(fused, partial: torch.Tensor, row: int, out: torch.Tensor) -> None:
    """One block of the fused down kernel (expert 3, a mixed table) holding slot `row` alone, its input finished."""
    slots = out.shape[1]
    routing = triton_moe.Routing(_route(row, slots), sparse_zeros((slots, 1), torch.int64),
                                 _block(row, triton_moe.BLOCK_M), torch.tensor([3], dtype=torch.int32))
    triton_moe._down(partial=partial, routing=routing, keep=None, suh_down=fused.scales[("down", "suh")],
                     svh_down=fused.scales[("down", "svh")], down=MatrixArgs.of(fused.tables["down"]), out=out,
                     swiglu_limit=None, dedup=False, flags=Flags(route_on_input=False, dot_fp16=False))


def _prefill_down(fused, partial: torch.Tensor, row: int, out: torch.Tensor) -> None:
    """One block of the dequantized prefill's down GEMM holding slot `row` alone, over a random dequantized expert."""
    hidden = out.shape[-1]
    w = torch.randn(INTERMEDIATE * hidden, generator=torch.Generator().manual_seed(7))
    blocks = triton_prefill.ChunkBlocks(_block(row, triton_prefill.GEMM_BLOCK_M), torch.tensor([0], dtype=torch.int32),
                                        0, 1)
    triton_prefill._down(partial=partial, route=_route(row, out.shape[1]), blocks=blocks,
                         decoded=triton_prefill.Decoded(w, w.numel()),
                         svh_down=torch.ones((1, hidden), dtype=torch.float16), out=out[0],
                         flags=Flags(route_on_input=False, dot_fp16=False))


@pytest.mark.parametrize("down", [_fused_down, _prefill_down], ids=["fused", "prefill"])
def test_down_reads_and_writes_slots_past_two_to_the_31_floats(fused, down) -> None:
    """Slot 2^25 + 2 of a layer with intermediate 256 and hidden 128: its input at float 2^33 + 512 and its output
    at 2^32 + 256 (int32: 512 and 256, slot 2's rows). Equal to the same slot computed at row 2 of small buffers."""
    hidden = fused.hidden
    act = torch.randn(INTERMEDIATE, generator=torch.Generator().manual_seed(5))
    small_partial = torch.zeros((1, 2, 4, INTERMEDIATE))
    small_partial.view(-1)[2 * INTERMEDIATE: 3 * INTERMEDIATE] = act  # activation_rows: slot-major from the start
    want = torch.zeros((1, 4, hidden))
    down(fused, small_partial, 2, want)
    assert want[0, 2].abs().sum() > 0

    far = 2**25 + 2
    partial = sparse_zeros((1, 2, far + 1, INTERMEDIATE), torch.float32)
    partial.view(-1)[far * INTERMEDIATE: (far + 1) * INTERMEDIATE] = act
    out = sparse_zeros((1, far + 1, hidden), torch.float32)
    down(fused, partial, far, out)
    assert torch.equal(out[0, far], want[0, 2])
    assert (out[0, 2] == 0).all()
