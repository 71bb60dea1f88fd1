"""The block-size rules alone (kv/rules.py, no vLLM): which block each KV-cache group gets, and the refusals.

The resolver mirrors what vLLM's worker does with a block size; these cases use the kernel sizes vLLM 0.32/0.33
declare for DeepSeek-V4 and V4.1 and the CPU backend, and the SM120 pages of the kernel truth table.
"""

from __future__ import annotations

import pytest

from vllm_expert_offload.kv.rules import (
    BackendSizes,
    GroupFacts,
    KVBlockLayoutError,
    Member,
    check_block_sizes,
    kernel_block_sizes,
    resolve_block_sizes,
)

DSV4_INDEXER = BackendSizes("DEEPSEEK_V4_INDEXER", exact=(256,))
DSV4_MLA = BackendSizes("FLASHMLA_SPARSE_DSV4", exact=(256,))
CPU_ATTN = BackendSizes("CPU_ATTN", multiple_of=(32,))
SWA = BackendSizes("DEEPSEEK_SPARSE_SWA", multiple_of=(32,))


def dsv4_compressed(requested: int) -> GroupFacts:
    """DeepSeek-V4's packed group: indexer keys (ratio 4) beside the ratio-4 and ratio-128 MLA caches."""
    members = (Member(DSV4_INDEXER, 4), Member(DSV4_MLA, 4), Member(DSV4_MLA, 128))
    return GroupFacts("g2", members, requested, packed=True)



@pytest.mark.parametrize("requested", [16, 32, 64, 128, 256])
def test_dsv4_compressed_group_gets_256_token_pages(requested: int) -> None:
    assert resolve_block_sizes([dsv4_compressed(requested)]) == {"g2": 256}


def test_user_size_kept_where_the_backend_takes_it() -> None:
    groups = [
        GroupFacts("swa", (Member(SWA),), 64, packed=True),
        GroupFacts("full", (Member(CPU_ATTN),), 128),
        dsv4_compressed(512),  # compressed caches in a packed block may be split into 256-token kernel blocks
    ]
    assert resolve_block_sizes(groups) == {"swa": 64, "full": 128, "g2": 512}


def test_raised_to_the_smallest_workable_multiple() -> None:
    assert resolve_block_sizes([GroupFacts("full", (Member(CPU_ATTN),), 16)]) == {"full": 32}
    flexible_c128 = GroupFacts("c128", (Member(BackendSizes("FLASH_ATTN_MLA", multiple_of=(16,)), 128),), 64)
    assert resolve_block_sizes([flexible_c128]) == {"c128": 128}  # 64 would hold 0 ratio-128 states


def test_packed_token_cache_is_not_split() -> None:
    token_cache = GroupFacts("tok", (Member(BackendSizes("FIXED", exact=(256,))),), 512, packed=True)
    assert resolve_block_sizes([token_cache]) == {"tok": 256}
    assert resolve_block_sizes([GroupFacts("tok", token_cache.members, 512)]) == {"tok": 512}


def test_packed_compressed_cache_splits_only_into_unpadded_pages() -> None:
    """DeepSeek-V4.1 on SM90 (FlashMLA and indexer take [64]): a ratio-2 cache of 584 B records in 576 B-aligned
    pages would need 64-token kernel pages of 18,688 B, not a multiple of 576, so a 128-token block cannot be
    split; mega attention's 288 B NVFP4 records in 512 B-aligned pages can."""
    flashmla = BackendSizes("FLASHMLA_SPARSE_DSV41", exact=(64,))
    ratio1 = GroupFacts("r1", (Member(flashmla, 1, 584, 576),), 128, packed=True)
    ratio2 = GroupFacts("r2", (Member(flashmla, 2, 584, 576),), 128, packed=True)
    assert resolve_block_sizes([ratio1, ratio2]) == {"r1": 64, "r2": 64}
    mega = GroupFacts("mega", (Member(BackendSizes("FLASHMLA_MEGA_ATTN_DSV41", exact=(128,)), 2, 288, 512),), 256,
                      packed=True)
    assert resolve_block_sizes([mega]) == {"mega": 256}


@pytest.mark.parametrize(("kernel", "requested", "expected"),
                         [(128, 64, 128), (128, 128, 128), (64, 64, 64), (64, 128, 64)])
def test_dsv41_compressed_group(kernel: int, requested: int, expected: int) -> None:
    """Main MLA and indexer caches of ratio 1 and 2 in one packed group: SM100/SM120 kernels take [128], SM90 [64]."""
    mla = BackendSizes("FLASHINFER_MLA_SPARSE_DSV41", (kernel,))
    indexer = BackendSizes("DEEPSEEK_V41_INDEXER", (kernel,))
    members = (Member(mla, 1, 584, 576), Member(indexer, 1, 132, 576), Member(mla, 2, 584, 576),
               Member(indexer, 2, 132, 576))
    assert resolve_block_sizes([GroupFacts("g4", members, requested, packed=True)]) == {"g4": expected}


def test_impossible_layout_names_group_backends_and_sizes() -> None:
    impossible = GroupFacts("g1 (20 layers from model.layers.3.attn)", (Member(BackendSizes("TINY_MLA", (64,)), 128),),
                            64, packed=True)
    disjoint = GroupFacts("g2", (Member(BackendSizes("A", (64,))), Member(BackendSizes("B", (128,)))), 64)
    with pytest.raises(KVBlockLayoutError) as refused:
        resolve_block_sizes([impossible, dsv4_compressed(64), disjoint])
    message = str(refused.value)
    assert "KV-cache group g1 (20 layers from model.layers.3.attn): block size 64 is not usable" in message
    assert "TINY_MLA takes [64], compression ratio 128" in message
    assert "A takes [64]; B takes [128]" in message
    assert message.count("sizes that would work: none") == 2


def test_planned_size_refused_with_the_sizes_that_would_work() -> None:
    check_block_sizes([dsv4_compressed(256), GroupFacts("swa", (Member(SWA),), 64)])
    with pytest.raises(KVBlockLayoutError) as refused:
        check_block_sizes([dsv4_compressed(128)])
    message = str(refused.value)
    assert message.startswith("KV-cache group g2: block size 128 is not usable (DEEPSEEK_V4_INDEXER takes [256]")
    assert message.endswith("sizes that would work: 256, 512, 1024, 2048, 4096")


@pytest.mark.parametrize("requested", [64, 128, 256])
def test_dsv41_sm120_ratio_groups_get_64_states(requested: int) -> None:
    """SM120's kernel truth (64 states per page) as declarations: ratio-1 caches [64], ratio-2 caches [128]. One
    packed block cannot give both 64 states (ratio-1 caches are never split), so the spec hook decides per cache and
    the two ratios plan apart: 64 and 128 at every --block-size, whatever it asks."""
    flashinfer, indexer = "FLASHINFER_MLA_SPARSE_DSV41", "DEEPSEEK_V41_INDEXER"
    ratio1 = GroupFacts("r1", (Member(BackendSizes(flashinfer, (64,)), 1, 584, 576),
                               Member(BackendSizes(indexer, (64,)), 1, 132, 576)), requested, packed=True, gpu="SM120")
    ratio2 = GroupFacts("r2", (Member(BackendSizes(flashinfer, (128,)), 2, 584, 576),
                               Member(BackendSizes(indexer, (128,)), 2, 132, 576)), requested, packed=True, gpu="SM120")
    assert resolve_block_sizes([ratio1, ratio2]) == {"r1": 64, "r2": 128}
    both = GroupFacts("both", ratio1.members + ratio2.members, requested, packed=True, gpu="SM120")
    with pytest.raises(KVBlockLayoutError, match=r"KV-cache group both on SM120: block size \d+ is not usable "
                                                 r"\(FLASHINFER_MLA_SPARSE_DSV41 takes \[64\];.* sizes that would "
                                                 r"work: none"):
        resolve_block_sizes([both])


@pytest.mark.parametrize(("ratio", "size", "fits"), [(3, 6, True), (3, 4, False), (3, 9, True), (12, 18, False),
                                                     (12, 24, True), (6, 8, False), (5, 5, True)])
def test_a_compressed_cache_takes_only_whole_multiples_of_a_ratio_that_is_no_power_of_two(ratio, size, fits) -> None:
    """Every fixture ratio (1, 2, 4, 128) is a power of two, where "at least the ratio" and "a multiple of it"
    agree on every power-of-two block; ratios 3, 5, 6 and 12 tell them apart (a 4-token block of a ratio-3 cache
    leaves a token no page stores)."""
    group = GroupFacts("c", (Member(BackendSizes("ANY", multiple_of=(1,)), ratio),), size)
    assert (kernel_block_sizes(group, size) is not None) is fits
