"""The EXL3 custom ops (kernels/ops.py): torch.compile sees one opaque call per layer, whatever the layer does.

The targets below do what no graph may hold (a file-system call, a host read-back of routing, a Python cache),
as the real backends do; fullgraph=True makes Dynamo fail the moment it would have to trace into them.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from vllm_expert_offload.kernels import ops

HIDDEN, OUT = 16, 24


@functools.cache
def _weights() -> torch.Tensor:
    return torch.randn(HIDDEN, OUT, generator=torch.Generator().manual_seed(0))


class UntraceableLinear:
    """A dense target that stats a file and reads a cached tensor on every call."""

    def linear_forward(self, x: torch.Tensor) -> torch.Tensor:
        os.stat(__file__)
        return x @ _weights()[:, : x.shape[-1] + OUT - HIDDEN]


class UntraceableMoE:
    """A MoE target whose result depends on routing read back to the host (as the torch reference does)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def moe_forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        experts = sorted(set(topk_ids.reshape(-1).tolist()))
        return x[:, :HIDDEN] * self.scale * len(experts) * topk_weights.sum(dim=1, keepdim=True)


def _layer(linear_name: str, moe_name: str):
    def forward(x, weights, ids):
        hidden = ops.exl3_moe(None, moe_name, HIDDEN, x, weights, ids)
        return ops.exl3_linear(None, linear_name, OUT, torch.relu(hidden))
    return forward


def _inputs(tokens: int = 3):
    gen = torch.Generator().manual_seed(tokens)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(tokens)])
    return torch.randn(tokens, HIDDEN, generator=gen), torch.rand(tokens, 2, generator=gen), ids


def _eager(linear, moe, x, weights, ids):
    return linear.linear_forward(torch.relu(moe.moe_forward(x, weights, ids)))


@pytest.fixture
def registered():
    linear, moe = UntraceableLinear(), UntraceableMoE(2.0)
    ops.register_target("t.linear", linear)
    ops.register_target("t.moe", moe)
    yield linear, moe


def test_compiled_layer_calls_each_target_through_one_opaque_op(registered) -> None:
    linear, moe = registered
    compiled = torch.compile(_layer("t.linear", "t.moe"), backend="aot_eager", fullgraph=True, dynamic=True)
    for tokens in (3, 5):  # one graph for every batch size: the fake impls give the shapes symbolically
        x, weights, ids = _inputs(tokens)
        torch.testing.assert_close(compiled(x, weights, ids), _eager(linear, moe, x, weights, ids))


@pytest.mark.parametrize(("part", "why"), [("moe", "data-dependent"), ("linear", "marked as skipped")])
def test_tracing_the_targets_themselves_fails(part: str, why: str) -> None:
    """Negative control: either target traced without its op cannot be compiled whole."""
    linear, moe = UntraceableLinear(), UntraceableMoE(2.0)
    x, weights, ids = _inputs()
    run = (lambda: moe.moe_forward(x, weights, ids)) if part == "moe" else (lambda: linear.linear_forward(x))
    with pytest.raises(Exception, match=why):
        torch.compile(run, backend="aot_eager", fullgraph=True)()


def test_fake_implementations_give_the_output_shapes() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, weights, ids = torch.empty(7, 20), torch.empty(7, 2), torch.empty(7, 2, dtype=torch.int64)
        moe = torch.ops.vllm_expert_offload.exl3_moe(x, weights, ids, "nowhere", HIDDEN)
        linear = torch.ops.vllm_expert_offload.exl3_linear(torch.empty(2, 7, HIDDEN), "nowhere", OUT)
    assert tuple(moe.shape) == (7, HIDDEN) and tuple(linear.shape) == (2, 7, OUT)


def test_a_graph_resolves_names_through_the_resolver_at_run_time(registered) -> None:
    """The same compiled graph serves whichever engine the resolver points at (vLLM: its forward context)."""
    linear, _ = registered
    other_engine = {"t.linear": linear, "t.moe": UntraceableMoE(-3.0)}
    compiled = torch.compile(_layer("t.linear", "t.moe"), backend="aot_eager", fullgraph=True)
    x, weights, ids = _inputs()
    first = compiled(x, weights, ids)
    ops.set_resolver(other_engine.__getitem__)
    try:
        second = compiled(x, weights, ids)
    finally:
        ops.set_resolver(None)
    torch.testing.assert_close(second, _eager(linear, other_engine["t.moe"], x, weights, ids))
    assert not torch.allclose(first, second)


def test_eager_calls_run_the_target_directly_without_a_lookup() -> None:
    x, weights, ids = _inputs()
    moe = UntraceableMoE(1.5)  # never registered
    torch.testing.assert_close(ops.exl3_moe(moe, "unregistered", HIDDEN, x, weights, ids),
                               moe.moe_forward(x, weights, ids))


def test_an_unregistered_name_is_a_clear_error() -> None:
    with pytest.raises(KeyError, match="no EXL3 layer named 'missing' is registered"):
        torch.ops.vllm_expert_offload.exl3_linear(torch.zeros(1, HIDDEN), "missing", OUT)
