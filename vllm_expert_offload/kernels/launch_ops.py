"""Kernel launches as torch ops that write into tensors they are handed: what lets a backend's glue run on `meta`.

A trellis-reading backend is glue (device ops on the batch: rotations, gathers, block layouts) around launches of
its kernels. vLLM can capture the forward in a CUDA graph only if that glue never needs device data on the host
(`.item()`, `.tolist()`, a data-dependent shape, a copy to the host), and the one proof of that which no op name can
fool is to run the glue with every tensor on the `meta` device, where any such read raises. A kernel cannot run
there, so each launch is an op of the plugin's library: wherever tensors have memory its implementation launches
the kernel; on `meta`, and under fake tensors, it does nothing, because a launch only writes into outputs the
glue has already allocated, in shapes the glue chose. (The layer's whole forward is a further op, kernels/ops.py:
that one is what torch.compile sees.)

How a launch registers itself, once, where its module defines it: a Triton launch through its `LaunchSpec`
(launch_spec.py), which generates the schema argument list `register_launch` takes and calls the op by keyword;
`register_table_launch` for launchers of the `MatmulBackend.launch` contract (rotated.py), whose MatrixTable it
passes field by field. In a schema every tensor the kernel writes is marked `Tensor(a!)`, `Tensor(b!)`, ... and
the op returns nothing. Tools that count a forward's device ops (the launch census) find
every launch op's qualified name in `LAUNCH_OPS`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .matrix_table import MatrixTable
from .ops import LIBRARY

TableLaunch = Callable[..., None]  # (a, row_ids, block_matrix, table, out[, fill]): MatmulBackend.launch

_lib = torch.library.Library(LIBRARY, "FRAGMENT")  # noqa: TOR901 (kept alive for the ops' lifetime)
# "vllm_expert_offload::<name>" of every launch registered here -> its launcher (the compile census calls it on meta
# tensors with Triton's launches recorded, tools/compile_census.py)
LAUNCH_OPS: dict[str, Callable[..., None]] = {}


def _writes_nothing(*args: object) -> None:
    """The launch on `meta` or fake tensors: its outputs already have their shapes, and there is no data to write."""


def register_launch(name: str, arguments: str, launch: Callable[..., None]) -> Callable[..., None]:
    """Define `vllm_expert_offload::<name>(<arguments>) -> ()`, running `launch` on every device with memory and
    nothing on `meta` or under fake tensors; returns the op."""
    _lib.define(f"{name}({arguments}) -> ()")
    _lib.impl(name, launch, "CompositeExplicitAutograd")
    _lib.impl(name, _writes_nothing, "Meta")
    _lib._register_fake(name, _writes_nothing)
    LAUNCH_OPS[f"{LIBRARY}::{name}"] = launch
    return getattr(getattr(torch.ops, LIBRARY), name).default


_TABLE_FIELDS = dataclasses.fields(MatrixTable)
_SCHEMA_TYPES = {"torch.Tensor": "Tensor", "int": "int"}  # MatrixTable's field annotations -> schema types
TABLE_ARGUMENTS = ", ".join(
    ["Tensor a", "Tensor row_ids", "Tensor block_matrix"]
    + [f"{_SCHEMA_TYPES[field.type]} {field.name}" for field in _TABLE_FIELDS]
    + ["Tensor(a!) out", "Tensor? fill=None"]
)


def register_table_launch(name: str, launch: TableLaunch) -> TableLaunch:
    """`launch(a, row_ids, block_matrix, table, out[, fill])` behind op `name` (see `register_launch`), called the
    same way; `fill` (a write-through table, rotated.py) reaches `launch` only when given, so a launcher that cannot
    write through keeps its five-argument form. The fill's destinations are raw addresses, not tensors the op
    names: only the layer's own op (kernels/ops.py) is what torch.compile sees, so nothing reorders around them."""

    def unpacked(a, row_ids, block_matrix, *table_out_fill):
        # torch drops a trailing argument left at its default, so `fill` is there only when one was given
        fields = len(_TABLE_FIELDS)
        table, out, fill = table_out_fill[:fields], table_out_fill[fields], table_out_fill[fields + 1:]
        launch(a, row_ids, block_matrix, MatrixTable(*table), out, *(f for f in fill if f is not None))

    op = register_launch(name, TABLE_ARGUMENTS, unpacked)

    def through_op(a: torch.Tensor, row_ids: torch.Tensor, block_matrix: torch.Tensor, table: MatrixTable,
                   out: torch.Tensor, fill: torch.Tensor | None = None) -> None:
        op(a, row_ids, block_matrix, *(getattr(table, field.name) for field in _TABLE_FIELDS), out, fill)

    return through_op
