"""Every EXL3 forward as one opaque torch op, found by the layer's name: what torch.compile sees of the plugin.

vLLM compiles the model with torch.compile by default. Dynamo must not trace into a backend: its launchers
read pointer tables, cached extensions and Python state (the profiling flag, routing statistics), none of which
can be baked into a graph. So each EXL3 layer's forward is one call of `vllm_expert_offload::exl3_moe` or
`::exl3_linear`, whose arguments are the activations and the layer's name (a string constant in the graph, the
way vLLM's own attention and MoE ops name their layer), and whose fake implementation gives the output shape from
an integer argument alone. At run time a compiled graph's op finds the layer's target by name through the
resolver: inside vLLM the engine's own forward context (integration/methods/op_targets.py), so two engines in
one process never reach each other's layers and a graph reused from vLLM's compile cache resolves the names
afresh; without one (engine-free use: tests, benchmarks, the GPU check) this module's registry. Called eagerly
(no compilation in progress) the helpers below run the target directly, with nothing to look up.

Registered like vLLM's `direct_register_custom_op` (a Library fragment, one implementation for every device
under CompositeExplicitAutograd, a fake for tracing), without the per-call overhead of torch.library.custom_op.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Protocol

import torch

LIBRARY = "vllm_expert_offload"


class MoEOpTarget(Protocol):
    """What `exl3_moe` runs: a layer's routed experts, router-weighted and summed (this rank's share)."""

    def moe_forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor: ...


class LinearOpTarget(Protocol):
    """What `exl3_linear` runs: a dense EXL3 linear without its bias."""

    def linear_forward(self, x: torch.Tensor) -> torch.Tensor: ...


# Weak: a layer owns its target, the registry only finds it, so a dropped model frees its weights.
_REGISTRY: weakref.WeakValueDictionary[str, object] = weakref.WeakValueDictionary()


def register_target(name: str, target: object) -> None:
    """Make `target` the one `name` resolves to in engine-free use (vLLM's forward context replaces the lookup)."""
    _REGISTRY[name] = target


def resolve_registered(name: str) -> object:
    """The target registered under `name` in this module's registry."""
    target = _REGISTRY.get(name)
    if target is None:
        raise KeyError(f"no EXL3 layer named {name!r} is registered (register_target)")
    return target


_resolve: Callable[[str], object] = resolve_registered


def set_resolver(resolve: Callable[[str], object] | None) -> None:
    """Where the ops look layers up; None restores this module's registry."""
    global _resolve
    _resolve = resolve_registered if resolve is None else resolve


_lib = torch.library.Library(LIBRARY, "FRAGMENT")  # noqa: TOR901 (kept alive for the ops' lifetime)


def _exl3_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_name: str,
              hidden: int) -> torch.Tensor:
    return _resolve(layer_name).moe_forward(x, topk_weights, topk_ids)


def _exl3_moe_fake(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_name: str,
                   hidden: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], hidden)


def _exl3_linear(x: torch.Tensor, layer_name: str, out_features: int) -> torch.Tensor:
    return _resolve(layer_name).linear_forward(x)


def _exl3_linear_fake(x: torch.Tensor, layer_name: str, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


_lib.define("exl3_moe(Tensor x, Tensor topk_weights, Tensor topk_ids, str layer_name, int hidden) -> Tensor")
_lib.impl("exl3_moe", _exl3_moe, "CompositeExplicitAutograd")
_lib._register_fake("exl3_moe", _exl3_moe_fake)
_lib.define("exl3_linear(Tensor x, str layer_name, int out_features) -> Tensor")
_lib.impl("exl3_linear", _exl3_linear, "CompositeExplicitAutograd")
_lib._register_fake("exl3_linear", _exl3_linear_fake)


def exl3_moe(target: MoEOpTarget, layer_name: str, hidden: int, x: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor) -> torch.Tensor:
    """Routed experts of `target` (registered as `layer_name`) for x (tokens, hidden_in) -> (tokens, hidden): the op
    while torch.compile traces, a direct call when running eagerly (nothing to resolve, no dispatch overhead)."""
    if torch.compiler.is_compiling():
        return torch.ops.vllm_expert_offload.exl3_moe(x, topk_weights, topk_ids, layer_name, hidden)
    return target.moe_forward(x, topk_weights, topk_ids)


def exl3_linear(target: LinearOpTarget, layer_name: str, out_features: int, x: torch.Tensor) -> torch.Tensor:
    """Dense EXL3 linear `target` (registered as `layer_name`) for x (..., in) -> (..., out_features), no bias: the
    op while torch.compile traces, a direct call when running eagerly (vLLM computes logits outside its graph)."""
    if torch.compiler.is_compiling():
        return torch.ops.vllm_expert_offload.exl3_linear(x, layer_name, out_features)
    return target.linear_forward(x)
