"""The fused Triton kernels (kernels/triton_moe.py, kernels/triton_linear.py) under TRITON_INTERPRET=1.

References: the torch table kernel (`TableMoE`) for MoE layers and the dequantized product for dense linears,
as in test_exl3_kernels.py, within the same tolerance; launches counted with support/launch_census.py. Sizes
stay small: the interpreter costs milliseconds per program.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import triton
import triton.language as tl

from vllm_expert_offload.exl3 import parse_linear
from vllm_expert_offload.exl3.naming import PROJECTIONS
from vllm_expert_offload.kernels import triton_dequantize, triton_linear, triton_moe, triton_prefill
from vllm_expert_offload.kernels.contract import ExpertCrop
from vllm_expert_offload.kernels.expert_blocks import blocks_where, grouped_blocks, slot_counts
from vllm_expert_offload.kernels.linear import DequantizedLinear, LinearShard
from vllm_expert_offload.kernels.static_spec import LayerShape
from vllm_expert_offload.kernels.triton_dequantize import WORKSPACE, dequantize
from vllm_expert_offload.kernels.triton_fused import WORKSPACES
from vllm_expert_offload.kernels.triton_linear import FusedTritonLinear
from vllm_expert_offload.kernels.triton_moe import FusedTritonMoE, _block_rows, fused_moe
from vllm_expert_offload.tools.launch_census import count_launches

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
)
from support.moe_layers import (
    CPU,
    FULL,
    HIDDEN,
    TIERS,
    NoHostSync,
    assert_close_to_reference,
    assert_dequantize_every_rate,
    expert_sets,
    other_ranks_slots,
    placed_moe,
    routing,
)

SPLIT = (2, 2)  # (gate/up parts, down parts) at decode: down's 256 inputs really split; gate's 128 leave part 1 empty


def _builder(split: tuple[int, int]):
    return lambda layer: fused_moe(layer, split)


@pytest.fixture(scope="module")
def fused_layer():
    return placed_moe(FULL, _builder(SPLIT))


@pytest.mark.parametrize("tokens", [1, 2, 7, 8, 9, 64, 300])
def test_fused_moe_matches_table_kernel(fused_layer, tokens: int) -> None:
    """Decode (one program per slot, in-kernel dedup, split input), 17-64 tokens (dedup, one part) and prefill
    (rows sorted by expert into 16-row blocks; no expert reaches the dequantize threshold, 144) against the torch
    reference."""
    reference, fused, _ = fused_layer
    x, weights, ids = routing(tokens, seed=tokens)
    assert_close_to_reference(fused.forward(x, weights, ids, False), reference.forward(x, weights, ids, False))


@pytest.mark.parametrize(("tokens", "intermediate"), [(1, 640), (70, 384)])
def test_fused_moe_pairs_of_output_pieces(tokens: int, intermediate: int) -> None:
    """Hidden 256: at decode every gate/up and down program takes two 128-wide output pieces, the last gate/up
    program one alone (intermediate 640: pieces (0, 1), (2, 3) and 4, so a program starting its pair at 128·i
    rather than 256·i would leave piece 4 unwritten), at prefill one; both equal the torch reference."""
    crop = ExpertCrop(256, intermediate, 0)
    reference, fused, _ = placed_moe(crop, _builder(SPLIT), hidden=256, intermediate=intermediate)
    x, weights, ids = routing(tokens, seed=11, hidden=256)
    assert_close_to_reference(fused.forward(x, weights, ids, False), reference.forward(x, weights, ids, False))


def test_fused_moe_unsplit_matches_split() -> None:
    """The decode path without a split input (what a small GPU gets) computes the same layer."""
    reference, fused, _ = placed_moe(FULL, _builder((1, 1)))
    x, weights, ids = routing(3, seed=3)
    assert_close_to_reference(fused.forward(x, weights, ids, False), reference.forward(x, weights, ids, False))


@pytest.mark.parametrize("tokens", [5, 20])
def test_fused_moe_router_weight_on_input(fused_layer, tokens: int) -> None:
    reference, fused, _ = fused_layer
    x, weights, ids = routing(tokens, seed=1)
    want = reference.forward(x, weights, ids, True)
    assert_close_to_reference(fused.forward(x, weights, ids, True), want)
    assert not torch.allclose(want, reference.forward(x, weights, ids, False), rtol=1e-2)


@pytest.mark.parametrize(
    ("crop", "swiglu_limit"),
    [(ExpertCrop(100, 96, 32), None), (ExpertCrop(HIDDEN, 64, 192), 0.5)],  # as test_exl3_kernels.py
)
def test_fused_moe_tensor_parallel_crop_and_clamp(crop: ExpertCrop, swiglu_limit: float | None) -> None:
    """Decode (split gate/up), 17-64 tokens, and a prefill whose experts with 20 slots or more are dequantized."""
    reference, fused, _ = placed_moe(crop, _dense_builder((2, 1)), swiglu_limit, seed=1)
    for tokens in (3, 20, 70):
        x, weights, ids = routing(tokens, seed=tokens)
        x = x[:, : crop.hidden].contiguous()
        assert_close_to_reference(fused.forward(x, weights, ids, False), reference.forward(x, weights, ids, False))


@pytest.mark.parametrize("tokens", [3, 70])
def test_fused_moe_half_precision_activations(tokens: int) -> None:
    """fp16/bf16 models multiply in fp16 after the in-kernel rotation (as exllamav3), and a prefill's dequantized
    experts hold fp16 weights: close to fp32, in x's dtype."""
    reference, _, _ = placed_moe(FULL, _builder((1, 1)))
    x, weights, ids = routing(tokens, seed=tokens)
    want = reference.forward(x, weights, ids, False)
    fused_half = placed_moe(FULL, lambda layer: FusedTritonMoE(
        layer.experts, layer.tables, layer.scales, layer.arena, layer.crop, torch.float16, CPU, top_k=2,
        **DENSE))[1]
    for dtype in (torch.float16, torch.bfloat16):
        got = fused_half.forward(x.to(dtype), weights, ids, False)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


@triton.jit
def _probe_block_rows(ids_ptr, num_slots, matrix_ptr, rows_ptr, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr,
                      SLOTS_P2: tl.constexpr):
    block = tl.program_id(0)
    matrix, rows, row_ok, first = _block_rows(ids_ptr, TOP_K, 1, ids_ptr, ids_ptr, block, num_slots, TOP_K, True,
                                              BLOCK_M, SLOTS_P2)
    tl.store(matrix_ptr + block * 2 + tl.arange(0, 2), tl.where(tl.arange(0, 2) == 0, matrix, first.to(tl.int32)))
    tl.store(rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M), tl.where(row_ok, rows, -1))


@pytest.mark.parametrize(("tokens", "top_k", "block_m"), [(1, 2, 16), (8, 2, 16), (16, 4, 16), (40, 3, 16)])
def test_each_selected_expert_is_led_once_and_every_slot_gathered_once(tokens: int, top_k: int, block_m: int) -> None:
    """The in-kernel dedup: one leading program per BLOCK_M slots of each selected expert (so its trellis is read
    once per forward up to BLOCK_M slots, at 40 tokens twice), which gathers exactly the next BLOCK_M slots that
    chose it; the rest skip; the first leader of an expert is marked (it writes through)."""
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(6, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
    slots = tokens * top_k
    matrix = torch.full((slots, 2), -7, dtype=torch.int32)
    rows = torch.full((slots, block_m), -7, dtype=torch.int32)
    _probe_block_rows[(slots,)](ids, slots, matrix, rows, TOP_K=top_k, BLOCK_M=block_m,
                                SLOTS_P2=triton.next_power_of_2(slots))
    flat = ids.reshape(-1)
    leaders = [s for s in range(slots) if matrix[s, 0] >= 0]
    for expert in set(flat.tolist()):  # one leader per BLOCK_M of its slots, each gathering the next BLOCK_M
        chose = [r for r in range(slots) if flat[r] == expert]
        mine = [s for s in leaders if matrix[s, 0] == expert]
        assert mine == chose[::block_m]
        assert [int(r) for s in mine for r in rows[s] if r >= 0] == chose
        assert [int(matrix[s, 1]) for s in mine] == [1] + [0] * (len(mine) - 1)  # the first writes through
    assert len(leaders) == sum(-(-int(c) // block_m) for c in torch.bincount(flat) if c > 0)


def test_an_expert_chosen_by_more_slots_than_a_block_is_led_once_per_block() -> None:
    ids = torch.zeros(10, 2, dtype=torch.int32)  # 20 slots of expert 0, BLOCK_M 16: two leaders
    matrix = torch.full((20, 2), -7, dtype=torch.int32)
    rows = torch.full((20, 16), -7, dtype=torch.int32)
    _probe_block_rows[(20,)](ids, 20, matrix, rows, TOP_K=2, BLOCK_M=16, SLOTS_P2=32)
    leaders = [s for s in range(20) if matrix[s, 0] >= 0]
    assert leaders == [0, 16] and matrix[0, 1] == 1 and matrix[16, 1] == 0  # only the first writes through
    assert [int(r) for r in rows[0] if r >= 0] == list(range(16))
    assert [int(r) for r in rows[16] if r >= 0] == [16, 17, 18, 19]


# --- prefill: experts with many slots dequantized once (triton_prefill.py) -------------------------------

# The fp32 test experts take 98,304 floats each (gate, up: 128 x 256; down 256 x 128): two per chunk, three chunks.
DENSE = {"dequant_min_rows": 20, "dequant_workspace_bytes": 2 * 98304 * 4}


def _dense_builder(split: tuple[int, int]):
    return lambda layer: fused_moe(layer, split, **DENSE)


def _poison_workspaces(monkeypatch: pytest.MonkeyPatch, *purposes: str) -> None:
    """Every view of these fused-kernel workspaces handed to a forward starts as NaN: what no kernel writes shows."""
    take = WORKSPACES.take

    def poisoned(device: torch.device, purpose: str, shape: tuple[int, ...]) -> torch.Tensor:
        held = take(device, purpose, shape)
        return held.fill_(float("nan")) if purpose in purposes else held

    monkeypatch.setattr(WORKSPACES, "take", poisoned)


def _both_paths(ids: torch.Tensor) -> None:
    """Some selected expert reaches the threshold (dequantized) and some does not (fused kernels)."""
    counts = torch.bincount(ids.reshape(-1), minlength=len(TIERS))
    assert (counts >= DENSE["dequant_min_rows"]).any() and ((counts > 0) & (counts < DENSE["dequant_min_rows"])).any()


@pytest.mark.parametrize("on_input", [False, True])
def test_dequantized_prefill_matches_table_kernel(on_input: bool) -> None:
    """70 tokens, threshold 20: the experts with 20 slots or more decoded once into the workspace (three chunks of
    two) and multiplied by the grouped GEMMs, the others through the fused kernels' 16-row blocks; with the
    router weight on the output or on the input, equal to the torch reference."""
    reference, fused, _ = placed_moe(FULL, _dense_builder(SPLIT))
    assert fused.prefill.chunk == 2
    x, weights, ids = routing(70, seed=70)
    _both_paths(ids)
    assert_close_to_reference(fused.forward(x, weights, ids, on_input), reference.forward(x, weights, ids, on_input))


def test_fused_kernels_leave_the_dequantized_experts_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each slot is computed by one path: with the dequantized path's launches removed (and the per-slot outputs
    poisoned first), exactly the tokens that chose a dense expert come out NaN; the others are the reference's."""
    prefill = {**DENSE, "dequant_min_rows": 23}  # slots per expert 23, 17, 22, 30, 26, 22: experts 0, 3, 4 dense
    reference, fused, _ = placed_moe(FULL, lambda layer: fused_moe(layer, SPLIT, **prefill))
    x, weights, ids = routing(70, seed=70)
    want = reference.forward(x, weights, ids, False)
    _poison_workspaces(monkeypatch, "moe_out")
    monkeypatch.setattr(fused.prefill, "forward", lambda *args: None)
    got = fused.forward(x, weights, ids, False)
    counts = torch.bincount(ids.reshape(-1), minlength=len(TIERS))
    dense = (counts[ids] >= 23).any(dim=1)
    assert dense.any() and not dense.all()
    assert got[dense].isnan().all()
    assert_close_to_reference(got[~dense], want[~dense])


def test_each_chunk_takes_only_its_own_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the GEMMs of every chunk but the first (experts 0 and 1) removed and the per-slot buffers poisoned:
    tokens whose experts are all in the first chunk or below the threshold equal the reference, every token with a
    dense expert of a later chunk is NaN: the first chunk's GEMMs did not take its rows (with the zeros the
    workspace holds past the chunk)."""
    reference, fused, _ = placed_moe(FULL, _dense_builder(SPLIT))
    x, weights, ids = routing(70, seed=70)
    want = reference.forward(x, weights, ids, False)
    WORKSPACES.reserve(CPU, WORKSPACE, len(TIERS) * fused.prefill.matrix_stride)
    WORKSPACES.take(CPU, WORKSPACE, (len(TIERS) * fused.prefill.matrix_stride,)).zero_()
    _poison_workspaces(monkeypatch, "moe_out", "moe_partial")
    for name in ("_gate_up", "_down"):
        launch = getattr(triton_prefill, name)
        monkeypatch.setattr(triton_prefill, name,
                            lambda launch=launch, **args: launch(**args) if args["blocks"].first == 0 else None)
    got = fused.forward(x, weights, ids, False)
    counts = torch.bincount(ids.reshape(-1), minlength=len(TIERS))
    later = ((counts[ids] >= DENSE["dequant_min_rows"]) & (ids >= fused.prefill.chunk)).any(dim=1)
    assert later.any() and not later.all()
    assert got[later].isnan().all()
    assert_close_to_reference(got[~later], want[~later])


@pytest.mark.parametrize("tokens", [3, 20, 70])
def test_slots_of_expert_minus_one_add_nothing(monkeypatch: pytest.MonkeyPatch, tokens: int) -> None:
    """Expert parallelism's -1 with nonzero router weights, in every path: decode (split, in-kernel dedup), 17-64
    tokens and a prefill with dequantized experts (threshold 20). The per-slot buffers start as NaN, so a -1
    slot's unwritten rows would show in the sum; its token 0 (every slot -1) is exactly zero."""
    reference, fused, _ = placed_moe(FULL, _dense_builder(SPLIT))
    x, weights, ids = routing(tokens, seed=tokens)
    marked, want_ids, want_weights = other_ranks_slots(ids, weights)
    if tokens == 70:
        _both_paths(marked[marked >= 0])
    _poison_workspaces(monkeypatch, "moe_out", "moe_partial")
    got = fused.forward(x, weights, marked, False)
    assert (got[0] == 0).all()
    assert_close_to_reference(got, reference.forward(x, want_weights, want_ids, False))


def test_slot_counts_leave_out_expert_minus_one() -> None:
    assert slot_counts(torch.tensor([[1, -1], [-1, 1], [0, 3]]).reshape(-1), 4).tolist() == [1, 2, 0, 1]


def test_dequantized_prefill_launches_a_fixed_set() -> None:
    """Per chunk of experts three dequantize launches (gate, up, down) and the two GEMMs, whatever the batch;
    the fused kernels and the sum once."""
    _, fused, _ = placed_moe(FULL, _dense_builder(SPLIT))
    inputs, more = routing(70, seed=70), routing(130, seed=3)
    counts = count_launches(lambda: fused.forward(*inputs, False))
    assert counts == count_launches(lambda: fused.forward(*more, False))
    chunks = 3
    assert [counts[f"triton::{k}"] for k in ("dequantize_kernel", "grouped_gate_up_kernel", "grouped_down_kernel",
                                             "moe_gate_up_kernel", "moe_down_kernel", "moe_sum_kernel")] == [
        3 * chunks, chunks, chunks, 1, 1, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dequantize_every_rate_and_codebook(dtype: torch.dtype) -> None:
    assert_dequantize_every_rate(dtype, CPU)


def test_fold_form_follows_the_tensor_core_instruction() -> None:
    """wgmma (sm_90) takes the fold's 128-deep product whole; mma.sync targets (and off a GPU) the split form; the
    static report compiles, per target, the one form its launches take."""
    assert [triton_dequantize.split_fold_for(c) for c in (80, 89, 90, 100, 120)] == [True, True, False, True, True]
    assert triton_dequantize.split_fold(torch.device("cpu")) and triton_dequantize.split_fold(torch.device("meta"))
    kernels = triton_dequantize.static_kernels(LayerShape("tiny", 128, 128, 4, 2))
    for capability, split in ((90, False), (120, True)):
        launched = [k for k in kernels if k.launched_on is None or k.launched_on(capability)]
        assert [(k.name, k.constexprs["SPLIT"]) for k in launched if k.constexprs["FOLD"]] == [
            ("dequantize[mul1,folded]", split)]
        assert [k.name for k in launched if not k.constexprs["FOLD"]] == ["dequantize[mul1,plain]"]


def test_slot_counts_and_blocks_split_between_the_two_paths() -> None:
    ids = torch.tensor([2, 0, 2, 2, 1, 2, 0])
    counts = slot_counts(ids, 4)
    assert counts.tolist() == [2, 1, 4, 0]
    _, block_matrix = grouped_blocks(ids, 4, 2, counts)
    assert block_matrix.tolist() == [0, 1, 2, 2, -1, -1, -1, -1]
    assert blocks_where(block_matrix, counts, 2, at_least=True).tolist() == [0, -1, 2, 2, -1, -1, -1, -1]
    assert blocks_where(block_matrix, counts, 2, at_least=False).tolist() == [-1, 1, -1, -1, -1, -1, -1, -1]


# --- launches -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("tokens", "most"), [(1, 3), (8, 3), (64, 3), (65, 40)])
def test_moe_forward_launches(tokens: int, most: int) -> None:
    """Up to 64 tokens the three kernels and nothing else (no torch op at all); above, a fixed set of sorting
    ops beside them (the same count whatever the batch: counted at 65 and 130)."""
    _, fused, _ = placed_moe(FULL, _builder((2, 2)))
    inputs, prefill = routing(tokens, seed=tokens), routing(130, seed=3)
    counts = count_launches(lambda: fused.forward(*inputs, False))
    assert sum(counts.values()) <= most, counts
    assert [counts[f"triton::{k}"] for k in ("moe_gate_up_kernel", "moe_down_kernel", "moe_sum_kernel")] == [1, 1, 1]
    if tokens > 64:
        assert counts == count_launches(lambda: fused.forward(*prefill, False))


def test_launch_census_counts_the_shared_glue() -> None:
    """Negative control: the glue the CPU backend keeps dispatches dozens of torch ops per forward."""
    from vllm_expert_offload.kernels.triton_exl3 import TRITON_MATMUL

    _, glue, _ = placed_moe(FULL, TRITON_MATMUL)
    inputs = routing(1, seed=1)
    assert sum(count_launches(lambda: glue.forward(*inputs, False)).values()) > 20


@pytest.mark.parametrize(("split", "rows", "launches"), [(1, 1, 1), (2, 1, 2), (2, 33, 1)])
def test_dense_linear_launches(split: int, rows: int, launches: int) -> None:
    linear, x = _fused_linear(split), torch.randn(rows, 144)
    counts = count_launches(lambda: linear.forward(x))
    assert sum(counts.values()) == launches, counts


def test_dense_linear_prefill_launches() -> None:
    """Above the threshold: per chunk of a shard's columns one dequantize launch, then torch's matmul, rotation,
    ⊙ svh and copy into the output, and the padding zeroed; the same whatever the row count."""
    linear = _fused_linear(1, **LINEAR_DENSE)
    x, more = torch.randn(70, 144), torch.randn(130, 144)
    counts = count_launches(lambda: linear.forward(x))
    assert counts == count_launches(lambda: linear.forward(more))
    assert counts["triton::dequantize_kernel"] == 3 and "triton::linear_kernel" not in counts, counts  # q: 2, k: 1


def _recorded_launches(forward) -> dict[str, list[dict]]:
    """Every interpreted Triton launch of one call of `forward`: kernel name -> its arguments by name."""
    from triton.runtime.interpreter import InterpretedFunction

    launches: dict[str, list[dict]] = {}
    run = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        launches.setdefault(self.__name__, []).append(dict(zip(self.arg_names, args)) | kwargs)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    with mock.patch.object(InterpretedFunction, "run", recording):
        forward()
    return launches


def test_arguments_the_static_report_compiles_aligned_are_aligned_at_every_launch() -> None:
    """`bench-kernels --static` compiles each kernel as Triton's launch specialises it: an argument a kernel lists
    as aligned (StaticKernel.aligned) must be, at every launch of the backend's forwards, a pointer to 16-byte-aligned
    memory or a multiple of 16, or the report measures a variant that never runs. Recorded over the MoE prefill with
    dense experts in three chunks and the dense linear decoded in column chunks at offsets."""
    from vllm_expert_offload.kernels.static_spec import LayerShape
    from vllm_expert_offload.kernels.triton_exl3 import backend_static_kernels

    _, moe, _ = placed_moe(FULL, _dense_builder(SPLIT))
    inputs = routing(70, seed=70)
    _both_paths(inputs[2])
    launches = _recorded_launches(lambda: moe.forward(*inputs, False))
    linear = _fused_linear(1, **LINEAR_DENSE)
    for name, calls in _recorded_launches(lambda: linear.forward(torch.randn(70, 144))).items():
        launches.setdefault(name, []).extend(calls)
    from vllm_expert_offload.kernels import triton_dequantize, triton_moe, triton_prefill

    specs = (triton_moe.GATE_UP, triton_moe.DOWN, triton_moe.SUM, triton_prefill.GATE_UP, triton_prefill.DOWN,
             triton_dequantize.SPEC)
    declared = {spec.kernel.__name__: spec.declared_aligned() for spec in specs}
    checked = set()
    for kernel in backend_static_kernels(LayerShape("tiny", HIDDEN, 256, len(TIERS), 2)):
        for call in launches.get(kernel.fn.__name__, []) if kernel.aligned else []:
            # an int the report found aligned by the shape's value (a K step count, min_rows) holds at that shape
            for name in set(kernel.aligned) & declared[kernel.fn.__name__]:
                value = call[name]
                held = value.data_ptr() if isinstance(value, torch.Tensor) else value
                assert held % 16 == 0, (kernel.name, name, held)
                checked.add(kernel.fn.__name__)
    assert checked == {"dequantize_kernel", "grouped_gate_up_kernel", "grouped_down_kernel", "moe_gate_up_kernel",
                       "moe_down_kernel", "moe_sum_kernel"}


# --- dense linears --------------------------------------------------------------------------------------


def _shards() -> list[LinearShard]:
    """As test_exl3_kernels.py: q with this rank's part at an offset inside its cover and zero padding rows, k
    plain; the input at an offset in its cover."""
    q = parse_linear(make_layer(3, "mul1", 256, 256, seed=5), "q")
    k = parse_linear(make_layer(2, "mcg", 256, 128, seed=6), "k")
    return [LinearShard(q, 64, 160, 176, 96, 144), LinearShard(k, 0, 128, 128, 96, 144)]


def _fused_linear(split: int, dtype: torch.dtype = torch.float32, **prefill: int) -> FusedTritonLinear:
    return FusedTritonLinear(_shards(), dtype, CPU, split=split, **prefill)


# From 50 rows on, decoded once per forward; q (256 x 256) in two chunks of 128 columns, k in one.
LINEAR_DENSE = {"dequant_min_rows": 50, "dequant_workspace_bytes": 256 * 128 * 4}


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize(("rows", "prefill"), [(1, {}), (9, {}), (33, {}), (70, {}), (70, LINEAR_DENSE)])
def test_fused_linear_matches_dequantized(monkeypatch: pytest.MonkeyPatch, split: int, rows: int,
                                          prefill: dict[str, int]) -> None:
    """Decode (split or not), 16-row blocks up to the threshold, and above it each shard decoded once with its
    input side folded in (in chunks of columns) and multiplied by torch's matmul; new tensors start as NaN, so every
    output column, padding included, must be written."""
    x = torch.randn(rows, 144, generator=torch.Generator().manual_seed(rows))
    empty = torch.empty

    def poisoned(*args, **kwargs) -> torch.Tensor:
        made = empty(*args, **kwargs)
        return made.fill_(float("nan")) if made.is_floating_point() else made

    monkeypatch.setattr(torch, "empty", poisoned)
    got = _fused_linear(split, **prefill).forward(x)
    assert got.shape == (rows, 304)
    assert_close_to_reference(got, DequantizedLinear(_shards(), torch.float32, CPU).forward(x))
    assert (got[:, 160:176] == 0).all()  # padding rows are zero (the method adds the bias)


@pytest.mark.parametrize("rows", [3, 70])
def test_fused_linear_half_precision(rows: int) -> None:
    """At 70 rows the decoded weights are held in x's dtype (bf16's 8 bits included)."""
    x = torch.randn(rows, 144)
    want = DequantizedLinear(_shards(), torch.float32, CPU).forward(x)
    for split in (1, 2):
        kernel = _fused_linear(split, torch.float16, **LINEAR_DENSE)
        for dtype in (torch.float16, torch.bfloat16):
            got = kernel.forward(x.to(dtype))
            assert got.dtype == dtype
            torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2 * float(want.abs().max()))


# --- write-through (the expert cache's fill tables) -----------------------------------------------------


@pytest.mark.parametrize("tokens", [3, 70])
def test_write_through_copies_every_trellis_read_and_leaves_outputs_unchanged(tokens: int) -> None:
    """After one forward with fill tables for every expert, each selected expert's fill buffers equal its
    trellises bit for bit and the others stay untouched; the output is what it was without fill tables. At 70
    tokens the experts with 20 slots or more are dequantized, and the dequantize kernel writes them through."""
    _, fused, _ = placed_moe(FULL, _dense_builder((2, 2)))
    x, weights, ids = routing(tokens, seed=5)
    want = fused.forward(x, weights, ids, False)
    buffers = {p: [torch.zeros_like(e.projections[p].trellis) for e in fused.experts] for p in PROJECTIONS}
    fused.write_through({p: torch.tensor([b.data_ptr() for b in buffers[p]]) for p in PROJECTIONS})
    got = fused.forward(x, weights, ids, False)
    assert torch.equal(got, want)
    selected = set(ids.reshape(-1).tolist())
    for p in PROJECTIONS:
        for e, expert in enumerate(fused.experts):
            copied = torch.equal(buffers[p][e], expert.projections[p].trellis)
            assert copied == (e in selected), (p, e)
            if e not in selected:
                assert not buffers[p][e].any()
    fused.write_through(None)  # off: nothing more is written
    for p in PROJECTIONS:
        for b in buffers[p]:
            b.zero_()
    fused.forward(x, weights, ids, False)
    assert not any(b.any() for p in PROJECTIONS for b in buffers[p])


def test_write_through_only_where_the_fill_address_is_set() -> None:
    """A 0 entry means no fill buffer: that expert reads as usual and nothing is written for it."""
    _, fused, _ = placed_moe(FULL, _builder((1, 1)))
    x, weights, ids = routing(20, seed=6)  # 17-64 tokens: one part, in-kernel dedup
    chosen = int(ids[0, 0])
    buffers = {p: torch.zeros_like(fused.experts[chosen].projections[p].trellis) for p in PROJECTIONS}
    table = {p: torch.zeros(len(TIERS), dtype=torch.int64) for p in PROJECTIONS}
    for p in PROJECTIONS:
        table[p][chosen] = buffers[p].data_ptr()
    fused.write_through(table)
    fused.forward(x, weights, ids, False)
    assert all(torch.equal(buffers[p], fused.experts[chosen].projections[p].trellis) for p in PROJECTIONS)
    with pytest.raises(ValueError, match=r"fill\['gate'\] must be int64"):
        fused.write_through({p: torch.zeros(3, dtype=torch.int32) for p in PROJECTIONS})


# --- no host synchronisation ----------------------------------------------------------------------------


def _meta_fused(**prefill: int):
    moe = fused_moe(meta_moe_layer(expert_sets(0), FULL), (2, 2), **prefill)
    layer = parse_linear(make_layer(3, "mul1", 128, 128, seed=8), "o")
    linear = FusedTritonLinear([LinearShard(layer, 0, 128, 128, 0, 128)], torch.float32, META, split=2, **prefill)
    return moe, linear


@pytest.mark.parametrize(("tokens", "prefill"), [(3, {}), (20, {}), (70, {}), (70, DENSE)])
def test_fused_forwards_run_with_every_tensor_on_meta(tokens: int, prefill: dict[str, int]) -> None:
    """Decode (split), 17-64 tokens (in-kernel dedup), prefill sorted by torch, and prefill with experts dequantized."""
    moe, linear = _meta_fused(**prefill)
    assert_all_on_meta(moe)
    assert_all_on_meta(linear)
    x, weights, ids = meta_routing(tokens, 2, HIDDEN)
    for on_input in (False, True):
        assert forward_on_meta(moe.forward, x, weights, ids, on_input).shape == (tokens, HIDDEN)
    assert forward_on_meta(linear.forward, x).shape == (tokens, 128)


@pytest.mark.parametrize("pattern", ["item", "tolist", "nonzero", "copy to a host tensor"])
def test_meta_proof_rejects_a_host_sync_planted_in_the_fused_forwards(monkeypatch: pytest.MonkeyPatch,
                                                                       pattern: str) -> None:
    moe, linear = _meta_fused()
    monkeypatch.setattr(triton_moe, "_gate_up", planted(triton_moe._gate_up, BAD_PATTERNS[pattern], argument="x"))
    monkeypatch.setattr(triton_linear, "_linear", planted(triton_linear._linear, BAD_PATTERNS[pattern], argument="x"))
    x, weights, ids = meta_routing(3, 2, HIDDEN)
    with pytest.raises(HOST_SYNC_ON_META, match="(?i)meta"):
        moe.forward(x, weights, ids, False)
    with pytest.raises(HOST_SYNC_ON_META, match="(?i)meta"):
        linear.forward(x)


@pytest.mark.parametrize(("tokens", "prefill"), [(3, {}), (70, {}), (70, DENSE)])
def test_fused_forwards_make_no_host_synchronisation_by_op_name(tokens: int, prefill: dict[str, int]) -> None:
    _, fused, _ = placed_moe(FULL, lambda layer: fused_moe(layer, (2, 2), **prefill))
    x, weights, ids = routing(tokens, seed=tokens)
    linear, rows = _fused_linear(2, **prefill), torch.randn(tokens, 144)
    with NoHostSync():
        fused.forward(x, weights, ids, False)
        linear.forward(rows)


def test_a_shared_expert_linear_and_the_routed_experts_never_take_the_same_workspace() -> None:
    """Issue 38 item 3: vLLM runs shared experts on aux_stream() (<= 256 tokens) while the routed experts run: any
    workspace purpose both take is one buffer written by two streams at once. Both dequantizing paths run here."""
    taken: dict[str, set[str]] = {"moe": set(), "linear": set()}
    take = WORKSPACES.take
    _, moe, _ = placed_moe(FULL, _dense_builder(SPLIT))
    inputs = routing(70, seed=70)
    linear = _fused_linear(1, **LINEAR_DENSE)
    for name, forward in (("moe", lambda: moe.forward(*inputs, False)),
                          ("linear", lambda: linear.forward(torch.randn(70, 144)))):
        def record(device, purpose, shape, name=name):
            taken[name].add(purpose)
            return take(device, purpose, shape)

        with mock.patch.object(WORKSPACES, "take", record):
            forward()
    assert WORKSPACE in taken["moe"] and taken["linear"], taken  # both dequantized their weights
    assert not taken["moe"] & taken["linear"], taken


@pytest.mark.parametrize("tokens", [3, 70])
def test_the_forward_hands_the_launches_dense_routing_views(tokens: int) -> None:
    """Router weights and ids that reach the layer as column views (last stride 2) run: the forward makes them dense
    (triton_moe_steps.dense_rows) before the launches, which compile their last strides as the constant 1 and refuse
    any other (tests/kernels/test_launch_spec.py). On meta, with the launchers run as a GPU launch runs them (the
    compile census's recording: arguments built and checked, nothing launched)."""
    from vllm_expert_offload.tools.compile_census import recorded_launches

    moe, _ = _meta_fused()
    x, weights, ids = meta_routing(tokens, 2, HIDDEN)
    wide_weights = torch.empty(tokens, 4, dtype=weights.dtype, device=weights.device)[:, ::2]
    wide_ids = torch.empty(tokens, 4, dtype=ids.dtype, device=ids.device)[:, ::2]
    assert wide_weights.stride(1) == wide_ids.stride(1) == 2
    with recorded_launches() as seen:
        assert moe.forward(x, wide_weights, wide_ids, False).shape == (tokens, HIDDEN)
    assert {key[0] for key in seen} >= {"moe_gate_up_kernel", "moe_down_kernel", "moe_sum_kernel"}
