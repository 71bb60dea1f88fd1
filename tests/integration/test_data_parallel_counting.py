"""What an engine counts: under data parallelism its own rows of the batch vLLM gathered from every engine (in DP
rank order, the step's dp_metadata sizes); never a padding row (a captured size's tail, every row of a dummy batch an
idle engine runs for the others' collectives). Padding is vLLM's device mask `forward_context.is_padding`, read as
data, so a replayed CUDA graph sees each step's (issue #38 item 7: a Python flag was frozen at capture)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_expert_offload.integration.methods import gathered_rows as data_parallel
from vllm_expert_offload.offload.process import ProcessPlacement

from support.moe_layers import NoHostSync
from support.moe_runtimes import runtime


class _Context(SimpleNamespace):
    """A forward context stand-in that, like vLLM's dataclass, can be referred to weakly."""


def _step(monkeypatch, sizes: list[int] | None, padding: list[bool] | None = None) -> SimpleNamespace:
    """A forward's context, as vLLM's set_forward_context makes one per forward: every layer of it sees this one."""
    import vllm.forward_context

    metadata = SimpleNamespace(get_chunk_sizes_across_dp_rank=lambda: sizes)
    context = _Context(dp_metadata=metadata, is_padding=None if padding is None else torch.tensor(padding))
    monkeypatch.setattr(vllm.forward_context, "is_forward_context_available", lambda: True)
    monkeypatch.setattr(vllm.forward_context, "get_forward_context", lambda: context)
    return context


def test_each_engine_takes_its_own_rows_in_rank_order() -> None:
    gathered = torch.arange(7 * 2).view(7, 2)  # engine 0: 3 tokens, engine 1: none (idle), engine 2: 4 tokens
    sizes = [3, 0, 4]
    assert data_parallel.own_rows(gathered, sizes, 0, 3).tolist() == gathered[:3].tolist()
    assert data_parallel.own_rows(gathered, sizes, 1, 3).numel() == 0
    assert data_parallel.own_rows(gathered, sizes, 2, 3).tolist() == gathered[3:].tolist()


@pytest.mark.parametrize("sizes", [None, [3, 3], [3, 4, 1]])
def test_a_batch_that_does_not_split_into_the_engines_shares_is_refused(sizes) -> None:
    with pytest.raises(data_parallel.GatheredBatchError, match=r"7 gathered tokens do not split into 3 engines"):
        data_parallel.own_rows(torch.zeros(7, 2), sizes, 1, 3)


def _counts(layers: int, experts: int) -> SimpleNamespace:
    """ProcessPlacement's counting state alone: one row per layer."""
    return SimpleNamespace(counts=torch.zeros(layers, experts, dtype=torch.int64), row=lambda layer: layer)


def test_record_adds_only_real_rows() -> None:
    placement = _counts(1, 6)
    ids = torch.tensor([[0, 1], [1, 5], [5, 5]])
    ProcessPlacement.record(placement, 0, ids, torch.tensor([True, False, True]))
    assert placement.counts[0].tolist() == [1, 1, 0, 0, 0, 2]
    ProcessPlacement.record(placement, 0, ids)  # no mask: every row
    assert placement.counts[0].tolist() == [2, 3, 0, 0, 0, 5]


def _engine_layer(**placement):
    """Layer 3 of DP rank 1 of 2 (no EP: every expert, as the engine test's other half covers EP), counting."""
    counting = _counts(4, 8)
    fields = {"recording": True, "dp_rank": 1, "dp_size": 2, "record": lambda layer, ids, real=None: (
        ProcessPlacement.record(counting, layer, ids, real))} | placement
    return runtime(torch.ones(8, dtype=torch.bool), layer_index=3, **fields), counting.counts[3]


class _DataParallelGroup:
    """vLLM's DP group as the layer uses it: all_gatherv of every engine's rows in DP rank order; engine 0's mask is
    `others`, this engine (rank 1) contributes its own."""

    def __init__(self, others: list[bool]) -> None:
        self.others = torch.tensor(others, dtype=torch.uint8)
        self.calls: list[list[int]] = []

    def all_gatherv(self, tensor: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
        assert dim == 0 and tensor.dtype == torch.uint8 and sizes[1] == tensor.shape[0]
        self.calls.append(sizes)
        return torch.cat([self.others, tensor])


def _dp_group(monkeypatch, others: list[bool]) -> _DataParallelGroup:
    from vllm_expert_offload.integration.methods import moe_runtime

    group = _DataParallelGroup(others)
    monkeypatch.setattr(moe_runtime, "get_dp_group", lambda: group)
    return group


def test_the_moe_forward_counts_its_engines_real_rows_only(monkeypatch) -> None:
    layer, counts = _engine_layer()
    _dp_group(monkeypatch, [False, False])
    gathered = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]])  # engine 0's two tokens, then this engine's two
    _step(monkeypatch, [2, 2], [False, True])  # this engine's second row is padding
    layer.forward(torch.zeros(4, 4), torch.full((4, 2), 0.5), gathered)
    assert counts.tolist() == [0, 0, 0, 0, 1, 1, 0, 0]
    _step(monkeypatch, [2, 2], [True, True])  # a dummy batch: every row of this engine is padding
    layer.forward(torch.zeros(4, 4), torch.full((4, 2), 0.5), gathered)
    assert counts.tolist() == [0, 0, 0, 0, 1, 1, 0, 0]
    assert layer.kernel.calls[-1][1].tolist() == [[0, 1], [2, 3], [-1, -1], [-1, -1]]


def test_other_engines_padding_reaches_no_kernel_counter_or_cache(monkeypatch) -> None:
    """Under data parallelism the batch holds every engine's rows; the layer all-gathers the engines' padding masks
    (as vLLM gathers their tokens) so engine 0's padding rows, like this engine's, are -1 for the kernel (which
    skips them and whose cache step neither counts nor ages by them) and the read counters: an idle engine's dummy
    batch is all padding. Device work only (a replayed graph sees each step's masks)."""
    layer, counts = _engine_layer(recording=False)
    group = _dp_group(monkeypatch, [False, True, True])  # engine 0: one real token padded to 3
    gathered = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [1, 2]])
    _step(monkeypatch, [3, 2], [True, False])  # this engine: its first row is padding
    with NoHostSync():
        layer.forward(torch.zeros(5, 4), torch.full((5, 2), 0.5), gathered)
    assert group.calls == [[3, 2]]
    assert layer.kernel.calls[-1][1].tolist() == [[0, 1], [-1, -1], [-1, -1], [-1, -1], [1, 2]]
    reads = layer.placement.tier_counters.counts[0]
    assert reads[:2].tolist() == [4, 0]  # two real tokens x top-2, all in the GPU tier
    group.others = torch.ones(3, dtype=torch.uint8)  # engine 0 idle: its dummy batch
    _step(monkeypatch, [3, 2], [True, True])  # and this one too: the whole batch is padding
    layer.forward(torch.zeros(5, 4), torch.full((5, 2), 0.5), gathered)
    assert (layer.kernel.calls[-1][1] == -1).all() and reads[:2].tolist() == [4, 0]


def test_a_batch_not_gathered_in_engine_order_keeps_other_engines_rows_and_warns(monkeypatch, caplog) -> None:
    """Sequence-parallel MoE or context parallelism gathers rows that are not the engines' shares in rank order:
    their masks cannot be matched, so only the routing statistics leave padding out, and the layer says so once."""
    from vllm_expert_offload.integration.methods import moe_runtime

    layer, _ = _engine_layer(recording=False)
    group = _dp_group(monkeypatch, [False, False])
    _step(monkeypatch, [2, 2], [False, True])
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]])  # 3 rows, not the 4 the shares add up to
    monkeypatch.setattr(moe_runtime, "_UNMASKED", set())
    with caplog.at_level("WARNING", logger="vllm.expert_offload"):
        layer.forward(torch.zeros(3, 4), torch.full((3, 2), 0.5), ids)
        layer.forward(torch.zeros(3, 4), torch.full((3, 2), 0.5), ids)
    assert group.calls == [] and layer.kernel.calls[-1][1].tolist() == ids.tolist()
    assert len([r for r in caplog.records if "other engines' padding rows are computed" in r.message]) == 1


def test_an_engine_whose_mask_is_not_its_share_is_refused_not_left_out_of_the_collective(monkeypatch) -> None:
    """The choice to gather is made from what every engine sees alike (the step's sizes, the batch's rows): an
    engine whose own mask disagrees with its share refuses by name instead of skipping the collective the other
    engines enter (which would hang them)."""
    layer, _ = _engine_layer(recording=False)
    group = _dp_group(monkeypatch, [False, False])
    _step(monkeypatch, [2, 2], [False, True, True])  # this engine's mask: 3 rows, its share: 2
    with pytest.raises(data_parallel.GatheredBatchError, match=r"is_padding covers 3 rows, this engine's share of "
                                                               r"the gathered batch is 2"):
        layer.forward(torch.zeros(4, 4), torch.full((4, 2), 0.5), torch.zeros((4, 2), dtype=torch.int64))
    assert group.calls == []


def test_without_data_parallelism_padding_rows_reach_nothing(monkeypatch) -> None:
    """One engine: padding rows' ids are -1 for the kernel (it skips them), the read counters and the routing
    statistics; every step device work (no host synchronisation: a captured graph replays it with the next
    step's mask)."""
    layer, counts = _engine_layer(dp_size=1, dp_rank=0)
    ids = torch.tensor([[0, 1], [2, 3], [4, 5]])
    _step(monkeypatch, None, [False, False, True])
    with NoHostSync():
        layer.forward(torch.zeros(3, 4), torch.full((3, 2), 0.5), ids)
    assert layer.kernel.calls[-1][1].tolist() == [[0, 1], [2, 3], [-1, -1]]
    assert counts.tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    reads = layer.placement.tier_counters.counts[0]
    assert reads[:2].tolist() == [4, 0]  # GPU reads, host reads: the padding row's two are not counted


def test_a_mask_that_does_not_cover_the_batch_is_refused(monkeypatch) -> None:
    layer, _ = _engine_layer(dp_size=1, dp_rank=0)
    _step(monkeypatch, None, [False, True])
    with pytest.raises(data_parallel.GatheredBatchError, match=r"is_padding covers 2 rows, .* is 3"):
        layer.forward(torch.zeros(3, 4), torch.full((3, 2), 0.5), torch.zeros((3, 2), dtype=torch.int64))


def test_with_padding_skips_off_vllms_mask_is_not_read(monkeypatch) -> None:
    """VLLM_MOE_SKIP_PADDING=0: vLLM's V2 runner stops filling is_padding for real steps (it still holds the last
    dummy batch's all-True rows) and its routers ignore it; so must the forward, or it drops real rows."""
    import vllm.envs

    layer, counts = _engine_layer(dp_size=1, dp_rank=0)
    ids = torch.tensor([[0, 1], [2, 3]])
    _step(monkeypatch, None, [True, True])  # stale: a dummy batch's mask
    monkeypatch.setenv("VLLM_MOE_SKIP_PADDING", "0")
    monkeypatch.setattr(vllm.envs, "VLLM_MOE_SKIP_PADDING", False, raising=False)
    layer.forward(torch.zeros(2, 4), torch.full((2, 2), 0.5), ids)
    assert layer.kernel.calls[-1][1].tolist() == ids.tolist()
    assert counts.tolist() == [1, 1, 1, 1, 0, 0, 0, 0]


def _layers(count: int) -> list:
    """`count` MoE layers of DP rank 1 of 2, as one forward runs them in order."""
    return [runtime(torch.ones(8, dtype=torch.bool), layer_index=i, dp_rank=1, dp_size=2) for i in range(count)]


def _forward(layers: list, rows: int) -> list[list[list[int]]]:
    """Every layer's forward on a gathered batch of `rows` rows; the ids each layer's kernel was handed."""
    ids = torch.arange(rows * 2).view(rows, 2) % 8
    for layer in layers:
        layer.forward(torch.zeros(rows, 4), torch.full((rows, 2), 0.5), ids)
    return [layer.kernel.calls[-1][1].tolist() for layer in layers]


@pytest.mark.parametrize("layers", [1, 5])
def test_a_step_gathers_the_engines_masks_once_for_all_its_moe_layers(monkeypatch, layers) -> None:
    """The masks are the same for every MoE layer of a forward: the first layer under the step's forward context
    gathers, the others reuse it (one collective per step, not one per layer); the next step gathers its own masks,
    never the last step's. Device work only."""
    group = _dp_group(monkeypatch, [False, True, True])  # engine 0: one real token of 3
    moe = _layers(layers)
    _step(monkeypatch, [3, 2], [True, False])
    with NoHostSync():
        seen = _forward(moe, 5)
    assert group.calls == [[3, 2]]
    assert seen == [[[0, 1], [-1, -1], [-1, -1], [-1, -1], [0, 1]]] * layers
    group.others = torch.tensor([False, False, True], dtype=torch.uint8)
    _step(monkeypatch, [3, 2], [False, True])  # the next step: other masks
    assert _forward(moe, 5) == [[[0, 1], [2, 3], [-1, -1], [6, 7], [-1, -1]]] * layers
    assert group.calls == [[3, 2], [3, 2]]


def test_an_idle_engines_dummy_forward_enters_as_many_collectives_as_a_busy_one(monkeypatch) -> None:
    """32f3f52's rule: no engine may skip a collective another enters. The busy engine and the idle one (its dummy
    batch all padding) each gather once per forward over the same layers."""
    busy = _dp_group(monkeypatch, [False, False])
    _step(monkeypatch, [2, 2], [False, False])
    _forward(_layers(4), 4)
    idle = _dp_group(monkeypatch, [False, False])
    _step(monkeypatch, [2, 2], [True, True])
    assert _forward(_layers(4), 4)[-1] == [[0, 1], [2, 3], [-1, -1], [-1, -1]]
    assert len(busy.calls) == len(idle.calls) == 1


def test_a_replay_batch_under_its_own_context_gathers_its_own_masks(monkeypatch) -> None:
    """DeepSeek-V4.1 runs its later layers on a replay batch, under a forward context (and a mask, replay_padding.py)
    of its own, its sizes the replay graph's: those layers gather that batch's masks once, the step's mask is not
    theirs. Two collectives in such a step."""
    group = _dp_group(monkeypatch, [False, True, True])
    moe = _layers(4)
    _step(monkeypatch, [3, 2], [False, True])
    assert _forward(moe[:2], 5) == [[[0, 1], [-1, -1], [-1, -1], [6, 7], [-1, -1]]] * 2
    group.others = torch.tensor([False, True], dtype=torch.uint8)
    _step(monkeypatch, [2, 2], [True, True])  # the replay batch: 2 rows per engine, this engine's both padding
    assert _forward(moe[2:], 4) == [[[0, 1], [-1, -1], [-1, -1], [-1, -1]]] * 2
    assert group.calls == [[3, 2], [2, 2]]


def test_a_context_whose_mask_or_sizes_change_gathers_again(monkeypatch) -> None:
    """A gather is reused only for the same mask object and sizes under the same context (a micro-batched step runs
    two batches; a layer must never read another batch's masks)."""
    group = _dp_group(monkeypatch, [False, True])
    context = _step(monkeypatch, [2, 2], [False, False])
    _forward(_layers(2), 4)
    context.is_padding = torch.tensor([True, False])  # another batch under this context
    assert _forward(_layers(1), 4) == [[[0, 1], [-1, -1], [-1, -1], [6, 7]]]
    group.others = torch.tensor([True, True, False], dtype=torch.uint8)
    context.dp_metadata = SimpleNamespace(get_chunk_sizes_across_dp_rank=lambda: [3, 2])
    assert _forward(_layers(1), 5) == [[[-1, -1], [-1, -1], [4, 5], [-1, -1], [0, 1]]]
    assert group.calls == [[2, 2], [2, 2], [3, 2]]


def test_a_gather_is_not_reused_across_a_capture_boundary(monkeypatch) -> None:
    """A mask gathered eagerly must not be read by a layer a CUDA graph captures (a replay would read a dead
    forward's memory), nor one gathered inside a capture by a layer run eagerly in that capture's break
    (DeepSeek-V4.1's replay layers during the main graph's capture: captured work is not computed then). Whether
    the stream captures is alike on every engine, so every engine regathers there."""
    group = _dp_group(monkeypatch, [False, True])
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    _step(monkeypatch, [2, 2], [False, True])
    moe = _layers(4)
    _forward(moe[:1], 4)
    capturing[0] = True
    _forward(moe[1:3], 4)
    capturing[0] = False
    assert _forward(moe[3:], 4) == [[[0, 1], [-1, -1], [4, 5], [-1, -1]]]
    assert group.calls == [[2, 2]] * 3


def test_the_next_forward_regathers_even_from_the_same_mask_buffer(monkeypatch) -> None:
    """vLLM's mask is a persistent buffer rewritten in place each step; a context may hand the layers the same tensor
    object as the last step's (dataclasses.replace of a context keeps it). A gather is held by its forward's context
    only, so the next forward's first layer gathers the new contents."""
    group = _dp_group(monkeypatch, [False, False])
    buffer, moe = torch.tensor([False, True]), _layers(2)
    context = _step(monkeypatch, [2, 2])
    context.is_padding = buffer
    assert _forward(moe, 4)[-1] == [[0, 1], [2, 3], [4, 5], [-1, -1]]
    buffer.copy_(torch.tensor([True, False]))
    _step(monkeypatch, [2, 2]).is_padding = buffer
    assert _forward(moe, 4) == [[[0, 1], [2, 3], [-1, -1], [6, 7]]] * 2
    assert len(group.calls) == 2


def test_a_forward_context_holds_its_gather_only_while_it_lives() -> None:
    """The gathered mask is kept beside vLLM's forward context, not on it (no attribute added to vLLM's object), and
    dropped with it: no forward's mask outlives its context, and a new context at a reused address starts empty.
    vLLM's ForwardContext can be referred to weakly, as the keeping needs."""
    import weakref

    from vllm.forward_context import ForwardContext

    from vllm_expert_offload.integration.methods import gathered_rows

    assert "__weakref__" in dir(ForwardContext)
    context, mask = _Context(), torch.zeros(2, dtype=torch.bool)
    gathered = gathered_rows.step_padding(context, mask, [1, 1], lambda: torch.ones(2, dtype=torch.bool))
    assert gathered_rows._STEP_MASKS[id(context)][1] is gathered and not hasattr(context, "_exl3_step_padding")
    alive = weakref.ref(context)
    del context
    assert alive() is None and gathered_rows._STEP_MASKS == {}
