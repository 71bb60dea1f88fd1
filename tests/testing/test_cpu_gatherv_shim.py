"""The test-only CPU collectives (tests/support/cpu_gatherv.py) against exact arithmetic: two gloo processes with
uneven shares, along dim 0 and another dim, a list of tensors, and the version and double-install refusals."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from support import cpu_gatherv

SIZES = [3, 1]


def _rank_data(rank: int) -> torch.Tensor:
    return torch.arange(SIZES[rank] * 4, dtype=torch.float32).view(SIZES[rank], 4) + 100 * rank


def _worker(rank: int, init: str, results) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    group = SimpleNamespace(world_size=2, rank_in_group=rank, device_group=dist.group.WORLD)
    mine = _rank_data(rank)
    gathered = cpu_gatherv.all_gatherv(group, [mine, mine[:, :1].long()], 0, SIZES)
    along_1 = cpu_gatherv.all_gatherv(group, mine.t().contiguous(), 1, SIZES)
    full = torch.arange(4 * 4, dtype=torch.float32).view(4, 4) * (rank + 1)  # sum over ranks: 3x
    scattered = cpu_gatherv.reduce_scatterv(group, full, 0, SIZES)
    results[rank] = (gathered[0], gathered[1], along_1, scattered)
    dist.destroy_process_group()


def test_uneven_shares_gather_and_scatter_exactly(tmp_path) -> None:
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(f"file://{tmp_path / 'store'}", results), nprocs=2)
    expected = torch.cat([_rank_data(0), _rank_data(1)])
    for rank in (0, 1):
        rows, ids, along_1, scattered = results[rank]
        assert torch.equal(rows, expected) and torch.equal(ids, expected[:, :1].long())
        assert torch.equal(along_1, expected.t())
        start = sum(SIZES[:rank])
        assert torch.equal(scattered, 3 * torch.arange(16, dtype=torch.float32).view(4, 4)[start: start + SIZES[rank]])


def test_sizes_that_do_not_fit_are_refused() -> None:
    group = SimpleNamespace(world_size=2, rank_in_group=0, device_group=None)
    with pytest.raises(ValueError, match="all_gatherv: sizes"):
        cpu_gatherv.all_gatherv(group, torch.zeros(2, 4), 0, [3, 1])
    with pytest.raises(ValueError, match="reduce_scatterv: sizes"):
        cpu_gatherv.reduce_scatterv(group, torch.zeros(5, 4), 0, [3, 1])


def test_another_vllm_is_refused(monkeypatch) -> None:
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    with pytest.raises(RuntimeError, match="written against vLLM 0.32.0.*this is vLLM 0.34.0"):
        cpu_gatherv._patch_communicator(SimpleNamespace(CpuCommunicator=type("C", (), {})))


def test_installing_after_vllm_loaded_its_communicator_is_refused() -> None:
    import vllm.distributed.device_communicators.cpu_communicator  # noqa: F401

    assert cpu_gatherv.COMMUNICATOR in sys.modules
    with pytest.raises(RuntimeError, match="before vLLM is imported"):
        cpu_gatherv.install()
