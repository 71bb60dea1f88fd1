"""The exllamav3 backend's call sites on the CPU, against a fake extension whose functions take exactly the
argument lists of exllamav3 1.6.5's headers (so a call the headers would not accept fails here) and compute
what the real kernels compute in a form simple enough to check: expert e maps a row x to (e + 1) x, so the
routing glue (sorting by expert, slot bases, the k-order gather, chunking, padding, router weights) is checked
exactly; exl3_gemm is the dequantized product. The kernels themselves run in tests/kernels/test_exllamav3_gpu.py."""

from __future__ import annotations

import types
from dataclasses import replace

import pytest
import torch

from vllm_expert_offload.exl3 import Codebook, Exl3Linear, parse_linear
from vllm_expert_offload.exl3.decode import dequantize_kn
from vllm_expert_offload.exl3.naming import PROJECTIONS
from vllm_expert_offload.kernels import exllamav3_backend
from vllm_expert_offload.kernels.contract import ExpertCrop, LinearLayer
from vllm_expert_offload.kernels.exllamav3_backend import MOE_ROWS, SIGNATURES, Exllamav3Linear, Exllamav3MoE
from vllm_expert_offload.kernels.linear import DequantizedLinear, LinearShard
from vllm_expert_offload.kernels.oracle import BackendUnavailable, KernelChoice, build_linear_kernel
from vllm_expert_offload.kernels.pointer_tables import build_pointer_tables, kernel_address, stack_scales
from vllm_expert_offload.memory import HostArena
from vllm_expert_offload.offload.phase import PHASE
from vllm_expert_offload.offload.tiers import host_record_bytes, place_expert
from vllm_expert_offload.tools.random_layers import random_linear

from support.exllamav3_headers import header_signature
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
from support.moe_layers import NoHostSync

CPU = torch.device("cpu")
EXPERTS, HIDDEN = 6, 128


def _coop(a: dict) -> None:
    """exl3_moe_coop_kernel.cuh's slot_info: a slot is active when its weight is nonzero and, with min_expert >= 0,
    its id is in [min_expert, max_expert); an active slot reads the tables at id - min_expert (must be in range)."""
    x, sel, rw = a["x"].float(), a["sel"], a["rw"].float()
    assert a["Hi"] == x.shape[1] and (a["ctr"] == 0).all()
    assert sel.shape[0] <= 8 and a["out"].shape[0] == 8  # fixed rows: the counter layout never moves
    active = rw != 0
    local = sel
    if a["min_expert"] >= 0:
        active &= (sel >= a["min_expert"]) & (sel < a["max_expert"])
        local = sel - a["min_expert"]
    read = local[active]
    assert ((read >= 0) & (read < a["u_trellis"].shape[0])).all(), f"tables read at {read.tolist()}"
    a["out"][: x.shape[0]] = torch.where(active, (local.float() + 1) * rw, 0).sum(1, keepdim=True) * x


def _moe(a: dict) -> None:
    """exl3_moe.cu: expert_count has num_experts + 1 bins, the last (the sentinel) ignored."""
    count, start = a["expert_count"], a["fused_base"]
    experts = a["gate_ptrs_trellis"].shape[0]
    assert count.shape == (experts + 1,) and a["num_active"] == -1 and a["count_lo"] == 1
    assert (count[:experts] <= a["count_hi"]).all()
    assert a["temp_state_g"].shape[1] >= a["count_hi"] and a["hidden_state"].dtype == torch.float16
    expert_of = torch.repeat_interleave(torch.arange(count.numel()), count)
    for i, (e, t) in enumerate(zip(expert_of.tolist(), a["token_sorted"].tolist())):
        if e == experts:
            continue
        slot = start[e] + i - (torch.cumsum(count, 0) - count)[e]
        a["output_scratch"][slot] = a["weight_sorted"][i].float() * (e + 1) * a["hidden_state"][t].float()


def _gather(a: dict) -> None:
    """exl3_moe_gather_kernel: a slot whose expert is outside [0, num_experts) adds nothing."""
    top_k = a["flat_expert"].numel() // a["output_state"].shape[0]
    for slot_index, e in enumerate(a["flat_expert"].tolist()):  # token-major, k order within a token
        if not 0 <= e < a["slot_kind"].numel():
            continue
        assert a["slot_kind"][e] == 1
        slot = a["slot_base"][e] + a["inv_order"][slot_index] - a["expert_start"][e]
        a["output_state"][slot_index // top_k] += a["output_scratch"][slot]


def _gemm(a: dict) -> None:
    codebook = Codebook.MCG if a["mcg"] else Codebook.MUL1 if a["mul1"] else Codebook.INST3
    layer = Exl3Linear("fake", a["B"], a["suh"], a["svh"], codebook, a["B"].shape[2] / 16)
    assert a["A"].dtype == torch.float16 and a["A_had"].shape == a["A"].shape and a["force_shape_idx"] == -1
    a["C"][:] = a["A"].float() @ dequantize_kn(layer)


SEMANTICS = {"exl3_moe_coop": _coop, "exl3_moe": _moe, "exl3_moe_gather": _gather,
             "exl3_moe_max_concurrency": lambda a: 2, "exl3_gemm": _gemm}


def make_fake_ext(semantics: dict) -> types.ModuleType:
    """An exllamav3_ext stand-in: each function takes the header's argument list and runs `semantics[name]` on it
    by the header's argument names; `calls` records the order of calls."""
    calls: list[str] = []

    def function(name: str):
        names = [argument for argument, _ in header_signature(name)]

        def call(*args):
            assert len(args) == len(names), f"{name} takes {len(names)} arguments, called with {len(args)}"
            calls.append(name)
            return semantics[name](dict(zip(names, args)))

        return call

    ext = types.ModuleType("exllamav3_ext")
    ext.calls = calls
    for name in SIGNATURES:
        setattr(ext, name, function(name))
    return ext


@pytest.fixture
def fake_ext() -> types.ModuleType:
    return make_fake_ext(SEMANTICS)


def _layer(fake_ext) -> Exllamav3MoE:
    """A uniform MUL1 layer, the odd experts in a host arena; every table is the plugin's own."""
    gen = torch.Generator().manual_seed(0)
    sets = [{p: random_linear(gen, HIDDEN, HIDDEN, 3) for p in PROJECTIONS} for _ in range(EXPERTS)]
    tiers = [e % 2 == 0 for e in range(EXPERTS)]
    arena = HostArena(sum(host_record_bytes(s) for s, gpu in zip(sets, tiers) if not gpu), device=CPU)
    placed, _ = stack_scales([place_expert(s, gpu, arena, CPU) for s, gpu in zip(sets, tiers)], CPU)
    tables = build_pointer_tables(placed, kernel_address(arena, CPU), CPU)
    return Exllamav3MoE(placed, tables, arena, ExpertCrop(HIDDEN - 32, HIDDEN, 0), CPU, ext=fake_ext)


def _routing(tokens: int, top_k: int):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN - 32, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:top_k] for _ in range(tokens)])
    return x, torch.rand(tokens, top_k, generator=gen), ids


@pytest.mark.parametrize(("tokens", "kernels"), [
    (1, ["exl3_moe_coop"]), (8, ["exl3_moe_coop"]),
    (9, ["exl3_moe_max_concurrency", "exl3_moe", "exl3_moe_gather"]),
    (2 * MOE_ROWS + 3, ["exl3_moe_max_concurrency"] + ["exl3_moe", "exl3_moe_gather"] * 3),
])
def test_moe_routes_every_slot_through_the_right_kernel(fake_ext, tokens: int, kernels: list[str]) -> None:
    layer = _layer(fake_ext)
    x, weights, ids = _routing(tokens, top_k=2)
    got = layer.forward(x, weights, ids, False)
    want = ((ids.float() + 1) * weights.half().float()).sum(1, keepdim=True) * x.half().float()
    assert fake_ext.calls == kernels and got.dtype == torch.bfloat16 and got.shape == x.shape
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("tokens", [1, 8, 9, MOE_ROWS + 5])
def test_moe_slots_of_expert_minus_one_add_nothing(fake_ext, tokens: int) -> None:
    """Expert parallelism's -1 (another rank's expert), with a nonzero router weight, in both kernels: the other
    slots' sum, and no table read at -1 (the fakes follow exllamav3's expert range and sentinel bin)."""
    layer = _layer(fake_ext)
    x, weights, ids = _routing(tokens, top_k=3)
    ids[::2, 1] = -1
    ids[0] = -1  # a token with no expert of this rank
    got = layer.forward(x, weights, ids, False)
    want = torch.where(ids >= 0, (ids.float() + 1) * weights.half().float(), 0).sum(1, keepdim=True) * x.half().float()
    assert (got[0] == 0).all()
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [2, 9])
def test_moe_output_is_contiguous_like_its_fake(fake_ext, dtype: torch.dtype, tokens: int) -> None:
    """The layer's width (96) is padded to 128 inside: the output is still a contiguous (tokens, 96) tensor, as
    the op's fake (kernels/ops.py) tells the compiler."""
    layer = _layer(fake_ext)
    x, weights, ids = _routing(tokens, top_k=2)
    got = layer.forward(x.to(dtype), weights, ids, False)
    assert got.shape == (tokens, HIDDEN - 32) and got.dtype == dtype and got.is_contiguous()


def test_moe_router_weight_on_input(fake_ext) -> None:
    layer = _layer(fake_ext)
    x, weights, ids = _routing(3, top_k=1)
    want = (ids.float() + 1) * (x * weights.to(x.dtype)).half().float()
    torch.testing.assert_close(layer.forward(x, weights, ids, True).float(), want, rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="top-k 1"):
        layer.forward(*_routing(3, top_k=2), True)


def test_moe_refuses_a_layer_outside_its_constraints(fake_ext) -> None:
    layer = _layer(fake_ext)
    mixed = [replace(layer.experts[0], projections={**layer.experts[0].projections,
                                                     "down": replace(layer.experts[0].projections["down"], k=4.0)})]
    with pytest.raises(ValueError, match="one K per projection"):
        Exllamav3MoE(mixed + layer.experts[1:], layer.pointer_tables, None, ExpertCrop(96, 128, 0), CPU, ext=fake_ext)


def test_warm_up_runs_once_in_the_profile_run(fake_ext) -> None:
    layer = _layer(fake_ext)
    with PHASE.profiling_pass():
        layer.forward(*_routing(2, top_k=2), False)
        layer.forward(*_routing(2, top_k=2), False)
    assert fake_ext.calls == ["exl3_moe_coop"] * 9 + ["exl3_moe_max_concurrency", "exl3_moe", "exl3_moe_gather",
                                                      "exl3_moe_coop"]
    linear = Exllamav3Linear([LinearShard(random_linear(torch.Generator(), 128, 128, 4), 0, 128, 128, 0, 128)], CPU,
                             capture_rows=(1, 4, 16), ext=fake_ext)
    fake_ext.calls.clear()
    with PHASE.profiling_pass():
        linear.forward(torch.randn(2, 128))
        linear.forward(torch.randn(2, 128))
    assert fake_ext.calls == ["exl3_gemm"] * 5  # three capture sizes, then the two calls


@pytest.mark.parametrize("rows", [1, 9])
def test_linear_matches_dequantized_for_fused_shards_with_offsets(fake_ext, rows: int) -> None:
    q = parse_linear(make_layer(3, "mcg", 256, 256, seed=5), "q")
    k = parse_linear(make_layer(2.5, "mul1", 256, 128, seed=6), "k")
    shards = [LinearShard(q, 64, 160, 176, 96, 144), LinearShard(k, 0, 128, 128, 96, 144)]
    x = torch.randn(rows, 144, generator=torch.Generator().manual_seed(rows))
    want = DequantizedLinear(shards, torch.float32, CPU).forward(x)
    got = Exllamav3Linear(shards, CPU, ext=fake_ext).forward(x)
    assert got.shape == (rows, 304) and fake_ext.calls == ["exl3_gemm"] * 2
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2 * float(want.abs().max()))


def _noop_ext() -> types.ModuleType:
    """The extension with kernels that do nothing: only the glue around them runs."""
    return make_fake_ext({name: (lambda a: 2) if name == "exl3_moe_max_concurrency" else (lambda a: None)
                          for name in SIGNATURES})


def _meta_kernels(ext: types.ModuleType) -> tuple[Exllamav3MoE, Exllamav3Linear]:
    """A uniform MUL1 layer and a dense linear, every tensor on meta (support/meta_proof.py)."""
    gen = torch.Generator().manual_seed(0)
    sets = [{p: random_linear(gen, HIDDEN, HIDDEN, 3) for p in PROJECTIONS} for _ in range(EXPERTS)]
    layer = meta_moe_layer(sets, ExpertCrop(HIDDEN - 32, HIDDEN, 0))
    moe = Exllamav3MoE(layer.experts, layer.tables, None, layer.crop, META, ext=ext)
    shard = LinearShard(random_linear(torch.Generator(), 128, 128, 4), 0, 128, 128, 0, 128)
    return moe, Exllamav3Linear([shard], META, ext=ext)


# Decode (exl3_moe_coop), prefill (exl3_moe + gather) and prefill in more than one chunk of MOE_ROWS tokens.
PROOF_TOKENS = [3, 20, MOE_ROWS + 5]


@pytest.mark.parametrize("tokens", PROOF_TOKENS)
def test_glue_runs_with_every_tensor_on_meta(tokens: int) -> None:
    """The no-sync proof: everything around the launches, router weights on the output or (top-k 1) the input."""
    moe, linear = _meta_kernels(_noop_ext())
    assert_all_on_meta(moe)
    assert_all_on_meta(linear)
    for top_k, on_input in ((2, False), (1, True)):
        x, weights, ids = meta_routing(tokens, top_k, HIDDEN - 32, torch.bfloat16)
        out = forward_on_meta(moe.forward, x, weights, ids, on_input)
        assert out.shape == x.shape and out.dtype == torch.bfloat16
    assert forward_on_meta(linear.forward, meta_routing(tokens, 1, 128)[0]).shape == (tokens, 128)


@pytest.mark.parametrize("pattern", list(BAD_PATTERNS))
@pytest.mark.parametrize("tokens", PROOF_TOKENS)
def test_meta_proof_rejects_a_host_sync_planted_in_the_glue(
    monkeypatch: pytest.MonkeyPatch, pattern: str, tokens: int
) -> None:
    """Each pattern planted on the routing ids the decode and prefill glue receive, and on a linear's input."""
    moe, linear = _meta_kernels(_noop_ext())
    for glue in ("_decode", "_prefill"):
        monkeypatch.setattr(Exllamav3MoE, glue, planted(getattr(Exllamav3MoE, glue), BAD_PATTERNS[pattern], 3))
    monkeypatch.setattr(Exllamav3Linear, "shard_product",
                        planted(Exllamav3Linear.shard_product, BAD_PATTERNS[pattern], 1))
    x, weights, ids = meta_routing(tokens, 2, HIDDEN - 32, torch.bfloat16)
    with pytest.raises(HOST_SYNC_ON_META, match="(?i)meta"):
        moe.forward(x, weights, ids, False)
    with pytest.raises(HOST_SYNC_ON_META, match="(?i)meta"):
        linear.forward(meta_routing(tokens, 1, 128)[0])


@pytest.mark.parametrize("tokens", [3, 20])
def test_glue_makes_no_host_synchronisation_by_op_name(tokens: int) -> None:
    """The second net, on real tensors (the kernels are no-ops here): no forbidden op is dispatched."""
    ext = _noop_ext()
    layer = _layer(ext)
    linear = Exllamav3Linear([LinearShard(random_linear(torch.Generator(), 128, 128, 4), 0, 128, 128, 0, 128)], CPU,
                             ext=ext)
    x, weights, ids = _routing(tokens, top_k=2)
    layer.forward(x, weights, ids, False)  # allocates the scratch and temps, once, before capture
    with NoHostSync():
        layer.forward(x, weights, ids, False)
        linear.forward(torch.randn(tokens, 128))


def _half_k_set(codebook: Codebook, name: str) -> Exl3Linear:
    """A 2.5-bit set under `codebook`, built directly (a checkpoint's sets are refused at parse unless MUL1)."""
    return replace(random_linear(torch.Generator().manual_seed(2), HIDDEN, HIDDEN, 2.5), name=name, codebook=codebook)


def test_half_integer_k_is_taken_with_mul1_and_refused_by_name_with_any_other_codebook(fake_ext) -> None:
    """exl3_moe_coop.cu, exl3_moe.cu and exl3_gemm.cu refuse half-integer K unless the codebook is MUL1."""
    layer = _layer(fake_ext)
    crop = ExpertCrop(HIDDEN - 32, HIDDEN, 0)
    mul1 = [replace(e, projections={**e.projections, "down": _half_k_set(Codebook.MUL1, f"experts.{i}.down")})
            for i, e in enumerate(layer.experts)]
    assert exllamav3_backend.moe_refusal(mul1, crop, None) is None
    mcg = [replace(e, projections={p: _half_k_set(Codebook.MCG, f"experts.{i}.{p}") for p in PROJECTIONS})
           for i, e in enumerate(layer.experts)]
    why = exllamav3_backend.moe_refusal(mcg, crop, None)
    assert why == "experts.0.gate: its kernels take half-integer K=2.5 with the MUL1 codebook only, and this set is mcg"
    with pytest.raises(ValueError, match="cannot compute this layer: experts.0.gate: .*half-integer K=2.5"):
        Exllamav3MoE(mcg, layer.pointer_tables, None, crop, CPU, ext=fake_ext)
    shard = LinearShard(_half_k_set(Codebook.MCG, "model.layers.0.self_attn.o_proj"), 0, HIDDEN, HIDDEN, 0, HIDDEN)
    assert "o_proj: its kernels take half-integer K=2.5" in exllamav3_backend.linear_refusal([shard])
    with pytest.raises(ValueError, match="cannot compute this linear: model.layers.0.self_attn.o_proj"):
        Exllamav3Linear([shard], CPU, ext=fake_ext)
    assert exllamav3_backend.linear_refusal([replace(shard, layer=_half_k_set(Codebook.MUL1, "o"))]) is None
    assert "K=5.5 is not a rate" in exllamav3_backend.rate_refusal(replace(shard.layer, k=5.5))
    assert fake_ext.calls == []  # refused before anything was launched


def test_a_linear_exllamav3_refuses_falls_back_in_auto_and_is_refused_when_asked_for(monkeypatch, fake_ext) -> None:
    monkeypatch.setattr(exllamav3_backend, "load_ext", lambda: fake_ext)
    refused = [LinearShard(_half_k_set(Codebook.MCG, "model.layers.3.mlp.down_proj"), 0, HIDDEN, HIDDEN, 0, HIDDEN)]
    taken = [LinearShard(random_linear(torch.Generator(), HIDDEN, HIDDEN, 4), 0, HIDDEN, HIDDEN, 0, HIDDEN)]
    auto = KernelChoice("exllamav3", "exllamav3", "test", fallback="torch")
    assert isinstance(build_linear_kernel(auto, LinearLayer(taken, torch.float32, CPU)), Exllamav3Linear)
    assert isinstance(build_linear_kernel(auto, LinearLayer(refused, torch.float32, CPU)), DequantizedLinear)
    with pytest.raises(BackendUnavailable, match=r"kernel='exllamav3' cannot compute model.layers.3.mlp.down_proj: "
                                                 r".*MUL1 codebook only"):
        build_linear_kernel(KernelChoice("exllamav3", "exllamav3", "test"), LinearLayer(refused, torch.float32, CPU))
