"""The trellis-reading backends on the CPU: the Triton kernel under TRITON_INTERPRET=1 (set by conftest before
Triton is imported) and the compiled CPU kernel, through the same launcher contract and the same glue.

References: the exact-arithmetic decoder in exl3_reference.py for W_hat (bit for bit), and the torch table
kernel (`TableMoE`, itself tested against the format definition) for whole MoE layers. Sizes stay small:
the interpreter costs about a millisecond per program.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from vllm_expert_offload.exl3 import Codebook, Exl3Linear, parse_linear
from vllm_expert_offload.errors import InvalidValueError
from vllm_expert_offload.kernels import rotated
from vllm_expert_offload.kernels.contract import ExpertCrop
from vllm_expert_offload.kernels.cpu_exl3 import CPU_MATMUL
from vllm_expert_offload.kernels.expert_blocks import grouped_blocks, per_row_blocks, single_matrix_blocks
from vllm_expert_offload.kernels.linear import DequantizedLinear, LinearShard
from vllm_expert_offload.kernels.matrix_table import matrix_table, own_addresses, present_key, present_values
from vllm_expert_offload.kernels.rotated import MatmulBackend, RotatedLinear, rotated_moe
from vllm_expert_offload.kernels.table_moe import TableMoE
from vllm_expert_offload.kernels.triton_exl3 import TRITON_MATMUL

from support import exl3_reference as ref
from support.layers import make_layer
from support.meta_proof import (
    BAD_PATTERNS,
    HOST_SYNC_ON_META,
    META,
    assert_all_on_meta,
    forward_on_meta,
    meta_moe_layer,
    meta_routing,
    planted,
    tensors_held,
)
from support.moe_layers import (
    ALL_RATES,
    CPU,
    FULL,
    HIDDEN,
    INTERMEDIATE,
    TIERS,
    NoHostSync,
    assert_close_to_reference,
    decode_with_kernel,
    expert_sets,
    other_ranks_slots,
    placed_moe,
    routing,
)

BACKENDS = {"triton": TRITON_MATMUL, "cpu": CPU_MATMUL}


@pytest.fixture(params=list(BACKENDS), scope="module")
def backend(request) -> MatmulBackend:
    return BACKENDS[request.param]


@pytest.mark.parametrize("chunk", range(3))
def test_decode_is_bit_exact_for_every_rate_and_codebook(backend: MatmulBackend, chunk: int) -> None:
    """Every K (1-8, 1.5/2.5/3.5) and codebook, nine matrices of mixed K and codebook per launch."""
    cases = ALL_RATES[chunk * 9 : (chunk + 1) * 9]
    layers = [parse_linear(make_layer(k, cb, 128, 128, seed=i)) for i, (k, cb) in enumerate(cases)]
    for (k, cb), layer, got in zip(cases, layers, decode_with_kernel(layers, backend)):
        expected = ref.rotated_weight_bits(layer.trellis.numpy(), k, cb).astype(np.int64)
        bits = got.half().view(torch.int16).numpy().astype(np.int64) & 0xFFFF
        assert np.array_equal(bits, expected), f"K={k} {cb}: {np.count_nonzero(bits != expected)} weights differ"


@pytest.mark.parametrize(("k", "codebooks"), [(3, ("3inst", "mcg", "mul1")), (2.5, ("mul1", "mul1"))])
def test_decode_is_bit_exact_with_the_rate_a_compile_time_constant(k: float, codebooks: tuple[str, ...]) -> None:
    """A table of one K (every codebook the rate allows): the Triton kernel compiles that rate's decode alone
    (uniform_twice_k), the path models with one K per projection take; the launches above branch on K at run time."""
    layers = [parse_linear(make_layer(k, cb, 128, 128, seed=i)) for i, cb in enumerate(codebooks)]
    assert matrix_table(layers, own_addresses(layers), CPU).uniform_twice_k == int(2 * k)
    for layer, got in zip(layers, decode_with_kernel(layers, TRITON_MATMUL)):
        expected = ref.rotated_weight_bits(layer.trellis.numpy(), k, layer.codebook.value).astype(np.int64)
        bits = got.half().view(torch.int16).numpy().astype(np.int64) & 0xFFFF
        assert np.array_equal(bits, expected), f"K={k} {layer.codebook}: {np.count_nonzero(bits != expected)} differ"


_REGISTER_PATH_CHECK = """
import numpy as np, torch
from vllm_expert_offload.exl3 import parse_linear
from vllm_expert_offload.kernels.triton_exl3 import TRITON_MATMUL
from vllm_expert_offload.kernels.triton_decode import _REGISTER_WINDOWS
assert _REGISTER_WINDOWS.value is True  # the environment variable took: the compiled path's register form
from support import exl3_reference as ref
from support.layers import make_layer
from support.moe_layers import decode_with_kernel
cases = [(3, "mul1"), (2.5, "mul1"), (4, "mcg"), (2, "3inst")]
layers = [parse_linear(make_layer(k, cb, 128, 128, seed=i)) for i, (k, cb) in enumerate(cases)]
for (k, cb), layer, got in zip(cases, layers, decode_with_kernel(layers, TRITON_MATMUL)):
    expected = ref.rotated_weight_bits(layer.trellis.numpy(), k, cb).astype(np.int64)
    bits = got.half().view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    assert np.array_equal(bits, expected), (k, cb, int(np.count_nonzero(bits != expected)))
"""


def test_register_windows_form_is_bit_exact_in_the_interpreter() -> None:
    """The GPU's form of the decode (each window from the thread's words at compile-time offsets, a join tree),
    which the interpreter otherwise replaces by one gather: run under the interpreter in a child Python."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", VLLM_EXPERT_OFFLOAD_TRITON_REGISTER_DECODE="1",
               PYTHONPATH=os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _REGISTER_PATH_CHECK], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_mixed_rates_leave_the_rate_to_the_kernel() -> None:
    """A mixed table's constexpr names the rates it holds (the decode compiles those alone), its codebook the one
    codebook they share."""
    layers = [parse_linear(make_layer(k, "mul1", 128, 128, seed=0)) for k in (3, 2.5, 3)]
    table = matrix_table(layers, own_addresses(layers), CPU)
    assert table.uniform_twice_k == -(1 << 5 | 1 << 6) and present_values(table.uniform_twice_k) == (5, 6)
    assert table.uniform_codebook == 2


@pytest.mark.parametrize(("values", "key"), [((6,), 6), ((0,), 0), ((0, 1), -3), ((16, 2, 16), -(1 << 16 | 4)),
                                             ((2, 0, 1), -7)])
def test_present_key_round_trips(values: tuple[int, ...], key: int) -> None:
    """One value is itself (0 too: the 3INST codebook id); several are minus their bit mask, never -1 or -2 (those
    would read as one value), and present_values gives them back ascending."""
    assert present_key(values) == key
    assert present_values(key) == tuple(sorted(set(values)))


@pytest.mark.parametrize("values", [(), (-1,), (3, -2)])
def test_present_key_refuses_what_no_table_holds(values: tuple[int, ...]) -> None:
    with pytest.raises(InvalidValueError, match="non-negative"):
        present_key(values)


def test_decode_negative_control_wrong_codebook_differs(backend: MatmulBackend) -> None:
    """The comparison above can fail: the same trellis read as MCG instead of MUL1 is another matrix."""
    layer = parse_linear(make_layer(3, "mul1", 128, 128, seed=0))
    wrong = Exl3Linear(layer.name, layer.trellis, layer.suh, layer.svh, Codebook.MCG, layer.k)
    expected = ref.rotated_weight_bits(layer.trellis.numpy(), 3, "mul1").astype(np.int64)
    bits = decode_with_kernel([wrong], backend)[0].half().view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    assert np.count_nonzero(bits != expected) > 128 * 128 // 2


def test_grouped_blocks_cover_every_row_once_with_its_matrix() -> None:
    gen = torch.Generator().manual_seed(0)
    for rows, matrices in ((1, 4), (37, 5), (300, 8)):
        ids = torch.randint(0, matrices, (rows,), generator=gen)
        row_ids, block_matrix = grouped_blocks(ids, matrices, 16)
        assert block_matrix.shape[0] == -(-rows // 16) + matrices  # depends on shapes only
        listed = row_ids.reshape(-1, 16)
        seen = sorted(int(r) for r in listed.flatten() if r >= 0)
        assert seen == list(range(rows))
        for block, members in zip(block_matrix.tolist(), listed.tolist()):
            members = [m for m in members if m >= 0]
            if block < 0:
                assert not members
            else:
                assert members and all(int(ids[m]) == block for m in members)
    per_row, per_block = per_row_blocks(torch.tensor([3, 1, 3]), 16)
    assert per_block.tolist() == [3, 1, 3] and per_row.reshape(3, 16)[:, 0].tolist() == [0, 1, 2]
    assert (per_row.reshape(3, 16)[:, 1:] == -1).all()
    ids = torch.tensor([2, -1, 0, 2, -1, -1, 1])  # rows of matrix -1 (another rank's expert) are in no block
    row_ids, block_matrix = grouped_blocks(ids, 3, 2)
    listed = {block: sorted(int(r) for r in rows if r >= 0)
              for block, rows in zip(block_matrix.tolist(), row_ids.reshape(-1, 2).tolist()) if block >= 0}
    assert listed == {0: [2], 1: [6], 2: [0, 3]} and block_matrix.shape[0] == -(-7 // 2) + 3
    rows_, blocks_ = single_matrix_blocks(17, 16, CPU)
    assert blocks_.tolist() == [0, 0] and rows_.tolist() == list(range(17)) + [-1] * 15


# --- routed experts -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def full_layer(backend: MatmulBackend):
    return placed_moe(FULL, backend)


@pytest.mark.parametrize("tokens", [1, 2, 7, 8, 9, 64, 300])
def test_moe_matches_table_kernel(full_layer, tokens: int) -> None:
    """Decode (Triton: <= 8 tokens, one slot per program) and grouped prefill against the torch reference."""
    reference, triton, _ = full_layer
    x, weights, ids = routing(tokens, seed=tokens)
    want = reference.forward(x, weights, ids, False)
    got = triton.forward(x, weights, ids, False)
    assert_close_to_reference(got, want)


def test_moe_router_weight_on_input(full_layer) -> None:
    reference, triton, _ = full_layer
    x, weights, ids = routing(5, seed=1)
    want = reference.forward(x, weights, ids, True)
    assert_close_to_reference(triton.forward(x, weights, ids, True), want)
    assert not torch.allclose(want, reference.forward(x, weights, ids, False), rtol=1e-2)


def test_torch_reference_skips_expert_minus_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slots of id -1 with nonzero weights add nothing, and no expert's weights are read for them: only the
    host-tier experts of the other slots are decoded (`experts[-1]` would read the last expert)."""
    reference, _, _ = placed_moe(FULL, CPU_MATMUL)
    read: list[int] = []
    weights_of = TableMoE._weights
    monkeypatch.setattr(reference, "_weights", lambda e, device: read.append(e) or weights_of(reference, e, device))
    x, weights, ids = routing(9, seed=9)
    marked, want_ids, want_weights = other_ranks_slots(ids, weights)
    got = reference.forward(x, weights, marked, False)
    host_read = sorted({e for e in marked.reshape(-1).tolist() if e >= 0 and not TIERS[e]})
    assert sorted(read) == host_read and (got[0] == 0).all()
    assert_close_to_reference(got, reference.forward(x, want_weights, want_ids, False))  # batches of other sizes


@pytest.mark.parametrize("tokens", [3, 20])
def test_moe_slots_of_expert_minus_one_add_nothing(full_layer, tokens: int) -> None:
    """The shared glue (per-slot blocks at decode, grouped above) with -1 slots carrying nonzero weights."""
    reference, kernel, _ = full_layer
    x, weights, ids = routing(tokens, seed=tokens)
    marked, want_ids, want_weights = other_ranks_slots(ids, weights)
    got = kernel.forward(x, weights, marked, False)
    assert (got[0] == 0).all()
    assert_close_to_reference(got, reference.forward(x, want_weights, want_ids, False))


@pytest.mark.parametrize(
    ("crop", "swiglu_limit"),
    [
        (ExpertCrop(100, 96, 32), None),  # hidden and intermediate not on 128-blocks, a non-zero crop offset
        (ExpertCrop(HIDDEN, 64, 192), 0.5),  # the last quarter of a simulated TP 4 split, clamp on
    ],
)
def test_moe_tensor_parallel_crop_and_clamp(
    backend: MatmulBackend, crop: ExpertCrop, swiglu_limit: float | None
) -> None:
    reference, triton, _ = placed_moe(crop, backend, swiglu_limit, seed=1)
    for tokens in (3, 20):
        x, weights, ids = routing(tokens, seed=tokens)
        x = x[:, : crop.hidden].contiguous()
        want = reference.forward(x, weights, ids, False)
        assert_close_to_reference(triton.forward(x, weights, ids, False), want)


def test_clamp_changes_the_result() -> None:
    """Negative control for the clamp case: a limit this low must matter, in both backends alike."""
    crop = ExpertCrop(HIDDEN, 64, 192)
    unclamped, _, _ = placed_moe(crop, CPU_MATMUL, None, seed=1)
    clamped, _, _ = placed_moe(crop, CPU_MATMUL, 0.5, seed=1)
    x, weights, ids = routing(3, seed=3)
    assert not torch.allclose(unclamped.forward(x, weights, ids, False), clamped.forward(x, weights, ids, False))


def test_moe_kernel_owns_what_its_tables_point_to(backend: MatmulBackend) -> None:
    """The tables hold raw addresses; once the loader's references are gone the kernel must keep the GPU-tier
    trellises alive (freed memory reused by new tensors would otherwise be decoded as weights)."""
    reference, triton, _ = placed_moe(FULL, backend, seed=2)
    x, weights, ids = routing(4, seed=4)
    want = reference.forward(x, weights, ids, False)
    del reference
    gc.collect()
    scribble = [torch.full((HIDDEN * INTERMEDIATE,), -1, dtype=torch.int16) for _ in range(64)]
    assert_close_to_reference(triton.forward(x, weights, ids, False), want)
    del scribble


# --- dense linears --------------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [1, 9, 33])
def test_linear_matches_dequantized_for_fused_shards_with_offsets(backend: MatmulBackend, rows: int) -> None:
    """Two shards of one fused layer: one with this rank's part inside its 128-cover at an offset (and zero
    padding rows, as a padded vocabulary), one plain; the input also sits at an offset in its cover."""
    q = parse_linear(make_layer(3, "mul1", 256, 256, seed=5), "q")
    k = parse_linear(make_layer(2.5, "mul1", 256, 128, seed=6), "k")
    shards = [LinearShard(q, 64, 160, 176, 96, 144), LinearShard(k, 0, 128, 128, 96, 144)]
    x = torch.randn(rows, 144, generator=torch.Generator().manual_seed(rows))
    want = DequantizedLinear(shards, torch.float32, CPU).forward(x)
    got = RotatedLinear(shards, CPU, backend).forward(x)
    assert got.shape == (rows, 304)
    assert_close_to_reference(got, want)
    assert (got[:, 160:176] == 0).all()  # padding rows are zero (the method adds the bias)


def test_linear_fp16_and_bf16_activations_round_like_exllamav3() -> None:
    """Half-precision models multiply in fp16 after the input rotation on Triton: close to fp32, not equal."""
    layer = parse_linear(make_layer(4, "mul1", 128, 128, seed=7), "o")
    shard = [LinearShard(layer, 0, 128, 128, 0, 128)]
    x = torch.randn(3, 128)
    want = DequantizedLinear(shard, torch.float32, CPU).forward(x)
    kernel = RotatedLinear(shard, CPU, TRITON_MATMUL)
    for dtype in (torch.float16, torch.bfloat16):
        got = kernel.forward(x.to(dtype))
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


# --- no host synchronisation (what CUDA-graph capture needs) -------------------------------------------


def _meta_kernels(backend: MatmulBackend, layer_sets=None):
    """The MoE (mixed K, codebooks) and a dense linear through `backend`, built with every tensor on meta."""
    moe = rotated_moe(meta_moe_layer(layer_sets or expert_sets(0), FULL), backend)
    layer = parse_linear(make_layer(3, "mul1", 128, 128, seed=8), "o")
    linear = RotatedLinear([LinearShard(layer, 0, 128, 128, 0, 128)], META, backend)
    return moe, linear


@pytest.mark.parametrize("tokens", [3, 20])  # per-slot blocks (Triton's decode) and grouped blocks
def test_glue_runs_with_every_tensor_on_meta(backend: MatmulBackend, tokens: int) -> None:
    """The no-sync proof (support/meta_proof.py): a forward that read device data on the host would raise here."""
    moe, linear = _meta_kernels(backend)
    assert_all_on_meta(moe)
    assert_all_on_meta(linear)
    x, weights, ids = meta_routing(tokens, 2, HIDDEN)
    for on_input in (False, True):
        assert forward_on_meta(moe.forward, x, weights, ids, on_input).shape == (tokens, HIDDEN)
    assert forward_on_meta(linear.forward, x).shape == (tokens, 128)


def test_torch_reference_fails_the_meta_proof() -> None:
    """Negative control: the torch reference decides per batch which experts to decode (`torch.unique(...)
    .tolist()`, then `nonzero`), by design."""
    layer = meta_moe_layer(expert_sets(0), FULL)
    reference = TableMoE(layer.experts, layer.tables, None, FULL, torch.float32, META)
    with pytest.raises(HOST_SYNC_ON_META, match="(?i)meta"):
        reference.forward(*meta_routing(3, 2, HIDDEN), False)


@pytest.mark.parametrize("pattern", list(BAD_PATTERNS))
@pytest.mark.parametrize("tokens", [3, 20])
def test_meta_proof_rejects_a_host_sync_planted_in_the_glue(
    backend: MatmulBackend, monkeypatch: pytest.MonkeyPatch, pattern: str, tokens: int
) -> None:
    """Each pattern planted on the routing ids (the MoE's block layouts) and on the activations (the rotations)."""
    moe, linear = _meta_kernels(backend)
    for glue in ("per_row_blocks", "grouped_blocks", "hadamard_last"):
        monkeypatch.setattr(rotated, glue, planted(getattr(rotated, glue), BAD_PATTERNS[pattern]))
    x, weights, ids = meta_routing(tokens, 2, HIDDEN)
    with pytest.raises(HOST_SYNC_ON_META, match="(?i)meta"):
        moe.forward(x, weights, ids, False)
    with pytest.raises(HOST_SYNC_ON_META, match="(?i)meta"):
        linear.forward(x)


@pytest.mark.parametrize("pattern", ["item", "bool of a tensor", "boolean-mask indexing", "nonzero", "unique",
                                     "bincount", "repeat_interleave without output_size"])
def test_op_name_net_catches_the_patterns_it_names(pattern: str) -> None:
    ids = torch.tensor([[0, 2], [1, 3]])
    with pytest.raises(AssertionError, match="host synchronisation"), NoHostSync():
        BAD_PATTERNS[pattern](ids)


@pytest.mark.parametrize("tokens", [3, 20])
def test_forward_makes_no_host_synchronisation_by_op_name(full_layer, backend: MatmulBackend, tokens: int) -> None:
    """The second net, on real tensors: no forbidden op is dispatched (NoHostSync names them)."""
    reference, triton, _ = full_layer
    x, weights, ids = routing(tokens, seed=tokens)
    layer = parse_linear(make_layer(3, "mul1", 128, 128, seed=8), "o")
    linear = RotatedLinear([LinearShard(layer, 0, 128, 128, 0, 128)], CPU, backend)
    with NoHostSync():
        triton.forward(x, weights, ids, False)
        linear.forward(x)
    with pytest.raises(AssertionError, match="host synchronisation"), NoHostSync():
        reference.forward(x, weights, ids, False)  # negative control: the torch reference does sync


def test_trellis_reading_linear_keeps_no_decoded_copy(backend: MatmulBackend) -> None:
    """What such a linear holds is the quantized set (trellis, scales) and its tiny tables, nothing dense."""
    layer = parse_linear(make_layer(3, "mul1", 256, 256, seed=9), "o")
    shards = [LinearShard(layer, 0, 256, 256, 0, 256)]
    held = tensors_held(RotatedLinear(shards, CPU, backend))
    assert not [t for t in held if t.is_floating_point() and t.dtype != torch.float16]
    quantized = sum(t.numel() * t.element_size() for t in (layer.trellis, layer.suh, layer.svh))
    assert sum(t.numel() * t.element_size() for t in held) <= quantized + 64
    dense = tensors_held(DequantizedLinear(shards, torch.float32, CPU))
    assert sum(t.numel() * t.element_size() for t in dense) == 256 * 256 * 4  # the opt-in does hold it


def test_trellis_reading_moe_holds_only_the_quantized_experts(backend: MatmulBackend) -> None:
    """The memory behind every tensor the MoE kernel holds, counted once per storage, is exactly: GPU-tier
    trellises, the host arena, each expert's suh/svh once, the small tables and the crop mask. Nothing decoded."""
    _, kernel, arena = placed_moe(FULL, backend, seed=3)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors_held(kernel)}
    experts = expert_sets(3)
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    gpu_trellises = sum(nbytes(lin.trellis) for s, gpu in zip(experts, TIERS) if gpu for lin in s.values())
    scales = sum(nbytes(lin.suh) + nbytes(lin.svh) for s in experts for lin in s.values())
    tables = sum(nbytes(t) for table in kernel.tables.values() for t in (table.trellis, table.twice_k, table.codebook))
    crop = 0 if kernel.keep_channels is None else nbytes(kernel.keep_channels)  # None: every channel kept
    assert sum(storages.values()) == gpu_trellises + arena.capacity_bytes + scales + tables + crop


def test_tensor_parallel_slice_of_a_linear_reads_the_right_tiles(backend: MatmulBackend) -> None:
    """A TP slice of the output dim is a strided view of the trellis; the kernel gets a dense copy (and a table
    over a strided trellis is refused rather than read as if it were dense)."""
    from vllm_expert_offload.exl3.slicing import cover_output

    whole = parse_linear(make_layer(3, "mul1", 128, 256, seed=11), "qkv")
    half, offset = cover_output(whole, 128, 256)
    assert not half.trellis.is_contiguous() and offset == 0
    shard = LinearShard(half, 0, 128, 128, 0, 128)
    x = torch.randn(2, 128)
    want = DequantizedLinear([shard], torch.float32, CPU).forward(x)
    assert_close_to_reference(RotatedLinear([shard], CPU, backend).forward(x), want)
    with pytest.raises(ValueError, match="qkv.trellis is a strided view"):
        matrix_table([half], own_addresses([half]), CPU)
