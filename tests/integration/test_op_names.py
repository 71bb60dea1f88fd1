"""Every EXL3 layer's op is named by its vLLM module prefix, never by a construction counter: a compiled graph
holds the name as a constant, so two engines that build the same layers in a different order (a draft model, a
second engine in the process, a graph from vLLM's compile cache) must each reach their own layer's weights."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.linear import ColumnParallelLinear

from vllm_expert_offload.integration.methods.linear_method import Exl3LinearMethod
from vllm_expert_offload.kernels import ops
from vllm_expert_offload.kernels.oracle import choose_kernels

from support import exl3_reference as ref

PREFIXES = ("model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj")
SIZE = 128


def _tensors(prefix: str) -> dict[str, torch.Tensor]:
    """Weights that differ per layer (seeded by the prefix), so reaching the wrong layer shows in the output."""
    rng = np.random.default_rng(PREFIXES.index(prefix))
    return {"trellis": torch.from_numpy(ref.random_trellis(rng, SIZE // 16, SIZE // 16, 3)),
            "suh": torch.from_numpy(rng.choice([-1.0, 1.0], SIZE).astype(np.float16)),
            "svh": torch.from_numpy(rng.uniform(0.5, 1.5, SIZE).astype(np.float16)),
            "mul1": torch.tensor(ref.MUL1_MARKER_INT32, dtype=torch.int32)}


def _build(prefix: str) -> Exl3LinearMethod:
    quant_config = SimpleNamespace(shard_prefixes=lambda p: [p], capture_sizes=lambda: (),
                                   kernel_choice=lambda device: choose_kernels("triton", device))
    method = Exl3LinearMethod(quant_config, prefix)
    layer = ColumnParallelLinear.__new__(ColumnParallelLinear)
    torch.nn.Module.__init__(layer)
    layer.tp_rank, layer.tp_size, layer.output_size = 0, 1, SIZE
    method.create_weights(layer, SIZE, [SIZE], SIZE, SIZE, torch.float32)
    for suffix, tensor in _tensors(prefix).items():
        method._load(getattr(layer, suffix), tensor)
    method.process_weights_after_loading(layer)
    return method


def _engine(order: tuple[str, ...]) -> tuple[VllmConfig, dict[str, Exl3LinearMethod]]:
    config = VllmConfig()
    with set_current_vllm_config(config):
        methods = {prefix: _build(prefix) for prefix in order}
    return config, methods


def test_two_constructions_in_different_order_reach_their_own_weights() -> None:
    engines = [_engine(PREFIXES), _engine(PREFIXES[::-1])]
    for _, methods in engines:
        assert {m.op_name for m in methods.values()} == {f"{p}.exl3" for p in PREFIXES}
        assert all(m.op_name == f"{p}.exl3" for p, m in methods.items())

    def model(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(ops.exl3_linear(None, f"{p}.exl3", SIZE, x) for p in PREFIXES)

    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # one graph: the names are constants
    x = torch.randn(2, SIZE, generator=torch.Generator().manual_seed(0))
    results = []
    for config, methods in engines:
        with set_forward_context(None, config):
            got = compiled(x)
        for prefix, y in zip(PREFIXES, got):
            torch.testing.assert_close(y, methods[prefix].linear_forward(x))
        results.append(got)
    assert not torch.allclose(results[0][0], results[0][1], rtol=1e-2)  # the two layers do differ
    for first, second in zip(*results):
        torch.testing.assert_close(first, second)  # the same layer in either construction order


def test_a_second_layer_with_the_same_name_is_refused() -> None:
    with set_current_vllm_config(VllmConfig()):
        _build(PREFIXES[0])
        with pytest.raises(Exception, match="duplicate EXL3 layer name 'model.layers.0.mlp.up_proj.exl3'"):
            _build(PREFIXES[0])
