"""Pointer tables of one MoE layer with mixed tiers: where every entry points, and reading back through it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from vllm_expert_offload.exl3 import Codebook, Exl3Linear, dequantize
from vllm_expert_offload.exl3.naming import PROJECTIONS
from vllm_expert_offload.kernels.pointer_tables import (
    PARTS,
    build_pointer_tables,
    gpu_tier_registry,
    kernel_address,
    read_trellis,
)
from vllm_expert_offload.memory import HostArena
from vllm_expert_offload.offload.tiers import host_record_bytes, place_expert

from support.cuda_alias import device_alias

HIDDEN, INTERMEDIATE = 128, 256
TIERS = (True, False, False, True, False, True)  # True = GPU tier
SHAPES = {"gate": (HIDDEN, INTERMEDIATE, 3), "up": (HIDDEN, INTERMEDIATE, 3), "down": (INTERMEDIATE, HIDDEN, 4)}


def random_linear(gen: torch.Generator, name: str, in_features: int, out_features: int, k: int) -> Exl3Linear:
    trellis = torch.randint(-(1 << 15), 1 << 15, (in_features // 16, out_features // 16, 16 * k), generator=gen,
                            dtype=torch.int16)
    suh = (torch.rand(in_features, generator=gen) + 0.5).half()
    svh = (torch.rand(out_features, generator=gen) - 0.5).half()
    return Exl3Linear(name=name, trellis=trellis, suh=suh, svh=svh, codebook=Codebook.MUL1, k=float(k))


def random_layer(seed: int = 0) -> list[dict[str, Exl3Linear]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        {p: random_linear(gen, f"experts.{e}.{p}_proj", *SHAPES[p]) for p in PROJECTIONS} for e in range(len(TIERS))
    ]


def sized_arena(layer: list[dict[str, Exl3Linear]], device: str) -> HostArena:
    return HostArena(sum(host_record_bytes(sets) for sets, gpu in zip(layer, TIERS) if not gpu), device=device)


def in_arena(arena: HostArena, address: int) -> bool:
    return arena.device_address(0) <= address < arena.device_address(0) + arena.capacity_bytes


@pytest.fixture
def placed_layer():
    layer = random_layer()
    arena = sized_arena(layer, "cpu")
    placed = [place_expert(sets, gpu, arena, "cpu") for sets, gpu in zip(layer, TIERS)]
    tables = build_pointer_tables(placed, kernel_address(arena, "cpu"))
    return layer, arena, placed, tables


def test_table_shapes(placed_layer) -> None:
    _, arena, _, tables = placed_layer
    assert len(tables.pointers) == 9
    for p in PROJECTIONS:
        for part in PARTS:
            table = tables.table(p, part)
            assert table.dtype == torch.int64 and table.shape == (len(TIERS),)
        assert tables.k[p].dtype == torch.float32 and tables.k[p].tolist() == [SHAPES[p][2]] * len(TIERS)
        assert tables.codebooks[p] == (Codebook.MUL1,) * len(TIERS)
    assert tables.in_gpu_tier.tolist() == list(TIERS)
    assert arena.used_bytes == arena.capacity_bytes  # sized by host_record_bytes: an exact fit


def test_entries_point_into_their_tier(placed_layer) -> None:
    _, arena, placed, tables = placed_layer
    for e, gpu in enumerate(TIERS):
        for p in PROJECTIONS:
            trellis = tables.table(p, "trellis")[e].item()
            assert in_arena(arena, trellis) != gpu, (e, p)
            assert gpu or trellis % 4096 == 0  # every host-tier trellis starts a page of its record
            for part in ("suh", "svh"):
                address = tables.table(p, part)[e].item()
                assert not in_arena(arena, address), (e, p, part)
                assert address == getattr(placed[e].projections[p], part).data_ptr()


def test_read_back_through_table_is_bit_identical(placed_layer) -> None:
    layer, arena, placed, tables = placed_layer
    registry = gpu_tier_registry(placed)
    for e, gpu in enumerate(TIERS):
        for p in PROJECTIONS:
            source = layer[e][p]
            got = read_trellis(tables.table(p, "trellis")[e].item(), source.trellis.shape, registry if gpu else arena)
            assert got.dtype == torch.int16 and torch.equal(got, source.trellis)
            assert got.data_ptr() != source.trellis.data_ptr()  # a placed copy, never the checkpoint's buffer
            placed_linear = placed[e].projections[p]
            assert torch.equal(placed_linear.suh.view(torch.int16), source.suh.view(torch.int16))
            assert torch.equal(placed_linear.svh.view(torch.int16), source.svh.view(torch.int16))


def test_reference_kernel_through_table_matches_source(placed_layer) -> None:
    layer, arena, placed, tables = placed_layer
    registry = gpu_tier_registry(placed)
    for e in (0, 1):  # one expert per tier
        source = layer[e]["down"]
        trellis = read_trellis(tables.table("down", "trellis")[e].item(), source.trellis.shape,
                               registry if TIERS[e] else arena)
        through_table = replace(placed[e].projections["down"], trellis=trellis)
        assert torch.equal(dequantize(through_table), dequantize(source))


def test_bad_entries_are_refused(placed_layer) -> None:
    _, arena, placed, _ = placed_layer
    with pytest.raises(KeyError, match="no registered trellis"):
        read_trellis(12345, (1,), gpu_tier_registry(placed))
    with pytest.raises(ValueError, match="reserved bytes"):
        read_trellis(arena.device_address(0) + arena.used_bytes - 2, (2,), arena)
    address = placed[0].projections["gate"].trellis.data_ptr()
    with pytest.raises(ValueError, match=r"expected torch.int16 \(1,\)"):
        read_trellis(address, (1,), gpu_tier_registry(placed))


def test_cuda_kernels_refuse_plain_host_tensors(placed_layer) -> None:
    _, arena, placed, _ = placed_layer
    address = kernel_address(arena, "cuda")
    host_record = placed[1].projections["up"].trellis
    assert address(host_record) == arena.device_address(arena.offset_of(host_record))
    with pytest.raises(ValueError, match="no address a cuda kernel can read"):
        address(placed[0].projections["up"].trellis)


def test_placement_preconditions() -> None:
    layer = random_layer()
    with pytest.raises(ValueError, match="needs a host arena"):
        place_expert(layer[1], False, None, "cpu")
    incomplete = place_expert({p: layer[0][p] for p in ("gate", "up")}, True, None, "cpu")
    with pytest.raises(ValueError, match=r"expert 0 lacks projection\(s\) \['down'\]"):
        build_pointer_tables([incomplete], kernel_address(None, "cpu"))


def _rounded(nbytes: int) -> int:
    return -(-nbytes // 512) * 512  # the CUDA caching allocator's block granularity


@pytest.mark.gpu
def test_cuda_tables_read_host_tier_over_the_mapping() -> None:
    layer = random_layer()
    arena = sized_arena(layer, "cuda")
    allocated = torch.cuda.memory_allocated()
    placed = [place_expert(sets, gpu, arena, "cuda") for sets, gpu in zip(layer, TIERS)]
    expected = sum(
        _rounded(t.numel() * t.element_size())
        for sets, gpu in zip(layer, TIERS)
        for linear in sets.values()
        for t in ((linear.trellis, linear.suh, linear.svh) if gpu else (linear.suh, linear.svh))
    )
    assert torch.cuda.memory_allocated() - allocated == expected  # host-tier trellises never entered VRAM
    tables = build_pointer_tables(placed, kernel_address(arena, "cuda"), device="cuda")
    for e, gpu in enumerate(TIERS):
        for p in PROJECTIONS:
            source = layer[e][p].trellis
            address = tables.table(p, "trellis")[e].item()
            assert in_arena(arena, address) != gpu
            assert torch.equal(device_alias(address, tuple(source.shape), torch.int16).cpu(), source)
