"""tools/exllamav3_cpu.py without the scratch build: the packed layout it hands exllamav3 (checked tile by tile
against moe_mul1.h's index formula), the reasons it gives when no build can be loaded, and undoing the CPU affinity
exllamav3 gives its caller."""

from __future__ import annotations

import os

import pytest
import torch

from vllm_expert_offload.tools.exllamav3_cpu import ENV, Exllamav3Layer, exllamav3_from, packed_trellis


@pytest.mark.parametrize("group,planar", [(0, 0), (8, 0), (2, 1)])
def test_packed_trellis_moves_tiles_and_dwords_where_the_header_says(group: int, planar: int) -> None:
    bits, tiles_k, tiles_n = 3, 3, 16  # tiles_k not a power of two
    trellis = torch.randint(-(1 << 15), 1 << 15, (tiles_k, tiles_n, 16 * bits), dtype=torch.int16)
    packed = packed_trellis(trellis, group, planar).view(torch.int32).reshape(-1, 8 * bits)
    native = trellis.view(torch.int32)
    for kt in range(tiles_k):
        for nt in range(tiles_n):
            slot = (nt // group) * tiles_k * group + kt * group + nt % group if group else kt * tiles_n + nt
            for w in range(8 * bits):
                moved = 8 * (w % bits) + w // bits if planar else w
                assert packed[slot, moved] == native[kt, nt, w]


def test_exllamav3_from_names_why_it_is_absent(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert exllamav3_from(None)[0] is None and ENV in exllamav3_from(None)[1]
    missing = tmp_path / "none.so"
    assert exllamav3_from(missing) == (None, f"exllamav3 build {missing} does not exist")
    monkeypatch.setenv(ENV, str(missing))
    assert str(missing) in exllamav3_from(None)[1]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning to one CPU changes nothing on one CPU")
def test_release_caller_restores_the_affinity_exllamav3_pinned() -> None:
    """exllamav3's pool pins its calling thread to one core; the benchmark's other kernel must not inherit that."""
    before = os.sched_getaffinity(0)

    class Pinning:  # what moe_mul1.cpp's Pool::ensure does to worker 0, the caller
        def forward(self, handle, x, ids, weights, out, threads) -> None:
            os.sched_setaffinity(0, {min(before)})
            out.fill_(1.0)

    layer = object.__new__(Exllamav3Layer)
    layer.module, layer.threads, layer.handle, layer.affinity = Pinning(), 2, 0, before
    try:
        out = layer.forward(torch.zeros(1, 4, dtype=torch.half), torch.zeros(1, 1), torch.zeros(1, 1, dtype=torch.int32))
        assert torch.equal(out, torch.ones(1, 4))
        assert os.sched_getaffinity(0) == {min(before)}  # as exllamav3 leaves it
        layer.release_caller()
        assert os.sched_getaffinity(0) == before
    finally:
        os.sched_setaffinity(0, before)
