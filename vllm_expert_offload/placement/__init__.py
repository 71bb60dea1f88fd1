"""Pure-Python placement layer: which routed experts go to GPU memory and which to the pinned host arena.

numpy only (no torch, no vLLM), so plans can be made, inspected and tested on any machine.
"""

from __future__ import annotations

from .cost import (
    DecodeCostModel,
    StepBound,
    batch_read_probability,
    expected_layer_bytes,
    step_bound,
    trace_layer_bytes,
)
from .datasets import UnsupportedRoutingFile, load_routing_dataset
from .errors import PlacementError
from .ledger import ARENA_ALIGNMENT, Ledger, LedgerRow
from .planfile import PLAN_FORMAT, PLAN_VERSION, ModelIdentity, load_plan, read_plan, save_plan
from .planner import plan_placement
from .stats import RoutingCounts, RoutingTrace, SegmentedCounts

__all__ = [
    "ARENA_ALIGNMENT",
    "DecodeCostModel",
    "Ledger",
    "LedgerRow",
    "ModelIdentity",
    "PLAN_FORMAT",
    "PLAN_VERSION",
    "PlacementError",
    "RoutingCounts",
    "RoutingTrace",
    "SegmentedCounts",
    "StepBound",
    "UnsupportedRoutingFile",
    "batch_read_probability",
    "expected_layer_bytes",
    "load_plan",
    "load_routing_dataset",
    "plan_placement",
    "read_plan",
    "save_plan",
    "step_bound",
    "trace_layer_bytes",
]
