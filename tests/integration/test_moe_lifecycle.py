"""Exl3MoEMethod's lifecycle: every attribute it has is declared when it is built (the loading, then the frozen
runtime), none appears or disappears by phase; and the runtime a loaded layer's forward reads cannot change."""

from __future__ import annotations

import ast
import dataclasses
import inspect

import pytest
import torch

from vllm_expert_offload.integration.methods import moe_method
from vllm_expert_offload.integration.methods.moe_runtime import MoERuntime

from support.moe_runtimes import runtime


def _self_attributes(nodes) -> tuple[set[str], set[str]]:
    """(attributes assigned on `self`, attributes deleted from `self`) in `nodes`, setattr/delattr included."""
    assigned, deleted = set(), set()
    for node in (n for root in nodes for n in ast.walk(root)):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        elif isinstance(node, ast.Delete):
            deleted |= {t.attr for t in node.targets if isinstance(t, ast.Attribute)
                        and isinstance(t.value, ast.Name) and t.value.id == "self"}
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Name) and first.id == "self":
                (assigned if node.func.id == "setattr" else deleted).add("<dynamic>")
        for target in (t for root in targets for t in ast.walk(root)):
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                assigned.add(target.attr)
    return assigned, deleted


def test_the_method_creates_no_attribute_after_construction() -> None:
    cls = next(n for n in ast.parse(inspect.getsource(moe_method)).body
               if isinstance(n, ast.ClassDef) and n.name == "Exl3MoEMethod")
    methods = [n for n in cls.body if isinstance(n, ast.FunctionDef)]
    declared, _ = _self_attributes([m for m in methods if m.name == "__init__"])
    later, deleted = _self_attributes([m for m in methods if m.name != "__init__"])
    assert declared >= {"quant_config", "loading", "runtime"}
    assert later <= declared, f"created after construction: {sorted(later - declared)}"
    assert not deleted, f"deleted by phase: {sorted(deleted)}"


def test_a_loaded_layers_runtime_is_frozen() -> None:
    layer = runtime(torch.tensor([True, False]))
    assert MoERuntime.__dataclass_params__.frozen
    for field in dataclasses.fields(MoERuntime):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(layer, field.name, None)
