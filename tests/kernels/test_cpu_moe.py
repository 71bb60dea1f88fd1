"""The C++ MoE forward (kernels/cpu_moe.py): its tile routine decodes W_hat bit-exactly on every ISA the CPU has,
for every K and codebook; the whole layer equals the decode.py-based torch reference (TableMoE) within fp32
reordering, with ids -1 contributing nothing, under a TP crop and the swiglu clamp, independently of the thread
count; bad ids and a second job in flight are refused."""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from vllm_expert_offload.exl3 import parse_linear
from vllm_expert_offload.kernels import cpu_exl3
from vllm_expert_offload.kernels.contract import ExpertCrop
from vllm_expert_offload.kernels.cpu_moe import CpuMoE, Exl3MoeJob, abi
from vllm_expert_offload.kernels.matrix_table import CODEBOOK_IDS, CODEBOOK_IDS_BY_NAME

from support import exl3_reference as ref
from support.cpu_isa import ISAS, use_isa
from support.layers import make_layer
from support.moe_layers import ALL_RATES, FULL, HIDDEN, TIERS, assert_close_to_reference, placed_moe, routing



@pytest.fixture(scope="module")
def extension() -> Iterator[object]:
    why = cpu_exl3.cpu_kernel_unavailable()
    if why is not None:
        pytest.skip(f"compiled extension unavailable: {why}")
    module = cpu_exl3.extension()
    chosen = module.exl3_cpu_isa()
    yield module
    module.exl3_set_cpu_isa(chosen)


@pytest.mark.parametrize("isa", ISAS)
def test_tile_routine_decodes_every_rate_exactly(extension, isa: str) -> None:
    use_isa(extension, isa)
    values = cpu_exl3.codebook_values()
    for i, (k, cb) in enumerate(ALL_RATES):
        layer = parse_linear(make_layer(k, cb, 128, 128, seed=i))
        expected = ref.rotated_weight_bits(layer.trellis.numpy(), k, cb).astype(np.int64)
        code = CODEBOOK_IDS[layer.codebook]
        for rows_per_block in (1, 5, 32):  # one-token path, a partial block, a full block
            out = torch.full((128, 128), float("nan"))
            extension.exl3_moe_matmul(torch.eye(128), layer.trellis.data_ptr(), round(2 * k), code, 128,
                                      rows_per_block, values, out)
            bits = out.half().view(torch.int16).numpy().astype(np.int64) & 0xFFFF
            assert np.array_equal(bits, expected), (isa, k, cb, rows_per_block)


def _beside_a_guard_page(data: np.ndarray, guard: str) -> tuple[mmap.mmap, int]:
    """A copy of `data` right before (guard="after") or right after (guard="before") a page that cannot be read:
    a load past the matrix's end or before its start crashes the process instead of reading whatever lies there."""
    page = mmap.PAGESIZE
    pages = -(-data.nbytes // page)
    buffer = mmap.mmap(-1, (pages + 1) * page)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    guard_at = pages * page if guard == "after" else 0
    assert libc.mprotect(base + guard_at, page, 0) == 0, ctypes.get_errno()  # PROT_NONE
    start = pages * page - data.nbytes if guard == "after" else page
    buffer[start:start + data.nbytes] = data.tobytes()
    return buffer, base + start


@pytest.mark.parametrize("guard", ["after", "before"])
@pytest.mark.parametrize("rows_per_block", [1, 3])
@pytest.mark.parametrize("isa", ISAS)
def test_decode_products_at_every_rate_read_nothing_outside_the_matrix(extension, isa: str, rows_per_block: int,
                                                                       guard: str) -> None:
    """Blocks of one row (a token's expert) and of three: AVX-512 decodes one row at K > 2 in stream order, AVX2
    every block of up to 8 rows, and both sum per-lane partial sums. Random inputs against float64 products of the
    reference W_hat, on a matrix that ends at an unreadable page (stream order loads 64 or 16 bytes at a time), or
    starts right after one (a tile's first windows wrap around to its end: they must be read from there). The
    sums are fp32 in another order, so they agree within 64 ulp-sized steps of sum |x w| (a 32-term fp32 sum errs by
    at most 31 * 2^-24 of it)."""
    use_isa(extension, isa)
    values = cpu_exl3.codebook_values()
    gen = torch.Generator().manual_seed(5)
    for i, (k, cb) in enumerate(ALL_RATES):
        trellis = ref.random_trellis(np.random.default_rng(40 + i), 2, 3, k)  # 2 x 3 tiles: 3 not a power of two
        weight = ref.rotated_weight_bits(trellis, k, cb).view(np.float16).astype(np.float64)
        buffer, address = _beside_a_guard_page(trellis, guard)
        x = torch.randn(3, 32, generator=gen)
        out = torch.full((3, 48), float("nan"))
        extension.exl3_moe_matmul(x, address, round(2 * k), CODEBOOK_IDS_BY_NAME[cb], 48, rows_per_block, values, out)
        want = x.double().numpy() @ weight
        bound = np.abs(x.double().numpy()) @ np.abs(weight)
        assert np.all(np.abs(out.double().numpy() - want) <= 64 * 2.0**-24 * bound), (isa, k, cb)
        buffer.close()


def _skipping(ids: torch.Tensor, weights: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Some slots set to -1, and the reference's equivalent: those slots routed to expert 0 with weight 0."""
    gen = torch.Generator().manual_seed(seed)
    skipped = torch.rand(ids.shape, generator=gen) < 0.4
    skipped[0] = True  # a token with no slot on this tier: its output is zero
    return ids.masked_fill(skipped, -1), weights.masked_fill(skipped, 0.0)


@pytest.mark.parametrize(
    ("crop", "swiglu_limit"),
    [
        (FULL, None),
        (ExpertCrop(100, 96, 32), None),  # hidden and intermediate not on 128-blocks, a non-zero crop offset
        (ExpertCrop(HIDDEN, 64, 192), 0.5),  # the last quarter of a simulated TP 4 split, clamp on
    ],
)
def test_forward_matches_the_reference_and_skips_minus_one(extension, crop: ExpertCrop,
                                                           swiglu_limit: float | None) -> None:
    reference, kernel, _ = placed_moe(crop, lambda layer: CpuMoE(layer, threads=2), swiglu_limit, seed=1)
    for tokens in (1, 3, 8, 40):  # 40: blocks of more than 32 rows for one expert
        x, weights, ids = routing(tokens, seed=tokens)
        x = x[:, : crop.hidden].contiguous()
        for on_input in (False, True):
            want = reference.forward(x, weights, ids, on_input)
            assert_close_to_reference(kernel.forward(x, weights, ids, on_input), want)
        skip_ids, skip_weights = _skipping(ids, weights, tokens)
        got = kernel.forward(x, weights, skip_ids, False)
        want = reference.forward(x, skip_weights, skip_ids.clamp(min=0), False)
        assert_close_to_reference(got, want)
        assert torch.equal(got[0], torch.zeros(crop.hidden))
        assert not torch.allclose(got, reference.forward(x, weights, ids, False), rtol=1e-2)


def test_result_does_not_depend_on_the_thread_count(extension) -> None:
    _, one, _ = placed_moe(FULL, lambda layer: CpuMoE(layer, threads=1), seed=2)
    _, three, _ = placed_moe(FULL, lambda layer: CpuMoE(layer, threads=3, cpus=(0,)), seed=2)
    assert (one.threads, three.threads) == (1, 3)
    x, weights, ids = routing(17, seed=5)
    assert torch.equal(one.forward(x, weights, ids), three.forward(x, weights, ids))


def test_bad_ids_are_refused_by_value(extension) -> None:
    _, kernel, _ = placed_moe(FULL, lambda layer: CpuMoE(layer, threads=2), seed=3)
    x, weights, ids = routing(2, seed=1)
    for bad in (len(TIERS), -2):
        wrong = ids.clone()
        wrong[1, 1] = bad
        with pytest.raises(RuntimeError, match=f"expert id {bad} outside"):
            kernel.forward(x, weights, wrong)
    kernel.forward(x, weights, ids)  # the layer is usable after a refused job


def test_c_abi_submit_wait_matches_forward_and_refuses_a_second_job(extension) -> None:
    _, kernel, _ = placed_moe(FULL, lambda layer: CpuMoE(layer, threads=2), seed=4)
    submit_address, wait_address, size = abi()
    assert size == ctypes.sizeof(Exl3MoeJob)
    prototype = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(Exl3MoeJob))
    submit, wait = prototype(submit_address), prototype(wait_address)
    x, weights, ids = routing(6, seed=9)
    ids32 = ids.to(torch.int32).contiguous()
    out = torch.full((6, HIDDEN), float("nan"))
    job = Exl3MoeJob(kernel.handle, x.data_ptr(), HIDDEN, ids32.data_ptr(), weights.data_ptr(), 6, 2, 0, out.data_ptr(),
               HIDDEN)
    assert submit(ctypes.byref(job)) == 0
    second = Exl3MoeJob(kernel.handle, x.data_ptr(), HIDDEN, ids32.data_ptr(), weights.data_ptr(), 6, 2, 0, out.data_ptr(),
                  HIDDEN)
    refused = submit(ctypes.byref(second))
    assert wait(ctypes.byref(job)) == 0 and job.state == 1
    if refused != 0:
        assert b"already has a job in flight" in second.error and second.state == -1
    else:  # the first job was already done when the second arrived: it ran too, and must finish first
        assert wait(ctypes.byref(second)) == 0 and second.state == 1
    assert torch.equal(out, kernel.forward(x, weights, ids))


@pytest.mark.timeout(60, method="thread")  # a lost job hangs in C, where a signal cannot reach
def test_two_layers_share_a_pool_while_a_job_is_in_flight(extension) -> None:
    """Layer A's job runs on the pool's workers (C ABI: submitted, not waited on) while layer B's synchronous
    forward, queued behind it on the same pool, is run by its own caller; both equal their references, the
    workers then run another job of A's alone, and a job without tokens is done at once."""
    ref_a, a, _ = placed_moe(FULL, lambda layer: CpuMoE(layer, threads=2), seed=1)
    ref_b, b, _ = placed_moe(FULL, lambda layer: CpuMoE(layer, threads=2), seed=2)
    submit_address, wait_address, _ = abi()
    prototype = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(Exl3MoeJob))
    submit, wait = prototype(submit_address), prototype(wait_address)
    x_a, weights_a, ids_a = routing(768, seed=3)
    ids32 = ids_a.to(torch.int32).contiguous()
    out_a = torch.full((768, HIDDEN), float("nan"))
    job = Exl3MoeJob(a.handle, x_a.data_ptr(), HIDDEN, ids32.data_ptr(), weights_a.data_ptr(), 768, 2, 0,
                     out_a.data_ptr(), HIDDEN)
    assert submit(ctypes.byref(job)) == 0
    x_b, weights_b, ids_b = routing(5, seed=4)
    got_b = b.forward(x_b, weights_b, ids_b)
    assert wait(ctypes.byref(job)) == 0 and job.state == 1
    want_a = ref_a.forward(x_a, weights_a, ids_a, False)
    assert_close_to_reference(out_a, want_a)
    assert_close_to_reference(got_b, ref_b.forward(x_b, weights_b, ids_b, False))
    # the workers take the next job (a job only they run would otherwise never end)
    out_a.fill_(float("nan"))
    assert submit(ctypes.byref(job)) == 0 and wait(ctypes.byref(job)) == 0
    assert_close_to_reference(out_a, want_a)
    empty = b.forward(x_b[:0], weights_b[:0], ids_b[:0])
    assert empty.shape == (0, HIDDEN)


def test_the_cpu_backend_builds_the_cpp_forward_without_a_cache(extension) -> None:
    """The oracle's cpu backend (the CPU engine's MoE layers) runs this kernel; with an expert cache it keeps the
    rotated glue, whose launcher writes experts through into their slots."""
    _, kernel, _ = placed_moe(FULL, cpu_exl3.BACKEND.build_moe, seed=6)
    assert isinstance(kernel, CpuMoE)
