"""The CPU tier reads the arena records the GPU's pointer tables map, in place (issue 41: no copy of weights).

On a GPU the host tier's records are pinned, mapped arena memory: the device tables hold the arena's device alias,
and the CPU MoE kernel (kernels/cpu_moe.py) must dereference the very same bytes through their host address.
"""

from __future__ import annotations

import torch

from vllm_expert_offload.exl3.naming import PROJECTIONS
from vllm_expert_offload.kernels.contract import MoELayer
from vllm_expert_offload.kernels.cpu_moe import host_trellis_addresses

from support.moe_layers import FULL, TIERS, placed_moe


def test_host_addresses_are_the_arena_records_the_device_tables_map() -> None:
    _, layer, arena = placed_moe(FULL, lambda built: built)
    assert isinstance(layer, MoELayer)
    host = host_trellis_addresses(layer)
    host_experts = [e for e, gpu in enumerate(TIERS) if not gpu]
    assert host_experts, "the fixture must hold host-tier experts"
    for row, p in enumerate(PROJECTIONS):
        table = layer.tables.pointers[(p, "trellis")].tolist()
        for e in host_experts:
            trellis = layer.experts[e].projections[p].trellis
            offset = arena.offset_of(trellis)  # refuses a tensor outside the arena: a copy would fail here
            assert table[e] == arena.device_address(offset)  # what the GPU kernel reads
            record = arena.view(offset, tuple(trellis.shape), trellis.dtype)
            assert int(host[row, e]) == record.data_ptr()  # what the CPU kernel reads: the same record
            assert torch.equal(record, trellis)
