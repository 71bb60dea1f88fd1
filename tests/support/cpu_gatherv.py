"""Test-only stand-in for the variable-size collectives vLLM 0.32's CPU build lacks, so data parallelism serves an
MoE model on the CPU test stack. Never shipped in the package and never installed by the plugin.

Under `--data-parallel-size` every MoE layer whose method has no modular kernel of its own (the plugin's) runs
vLLM's naive dispatch (`MoERunner.do_naive_dispatch_combine`, model_executor/layers/fused_moe/runner/
moe_runner.py): `AgRsAll2AllManager.dispatch_router_logits` gathers every engine's tokens with the DP group's
`all_gatherv`, and `combine` hands each engine its rows of the summed output with `reduce_scatterv`
(distributed/device_communicators/all2all.py). On a GPU these are NCCL's (`CudaCommunicator` through pynccl); the
CPU build's `CpuCommunicator` inherits `DeviceCommunicatorBase`'s, which raise NotImplementedError
(base_device_communicator.py), and the CPU platform always picks that all2all manager (cpu_communicator.py), so no
option avoids them. Here they are built on torch.distributed over the same device group: all_gatherv pads each
rank's rows to the largest, all-gathers, and cuts; reduce_scatterv all-reduces and keeps this rank's rows.

On a GPU the MoE layer runs as one opaque custom op (`torch.ops.vllm.moe_forward`, `MoERunner._select_forward`),
so these collectives run eagerly with the token counts of the step; vLLM 0.32's CPU build calls the layer's
Python directly inside the compiled graph, where Dynamo cannot trace collectives whose sizes come from the
step's data ("Could not guard on data-dependent expression"). The shim therefore also gives the CPU the GPU's
choice of entry point, so the test runs vLLM's default compiled mode (no --enforce-eager) the way a GPU does.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

WRITTEN_FOR = "0.32.0"  # base_device_communicator.py / cpu_communicator.py of this release were read for it
COMMUNICATOR = "vllm.distributed.device_communicators.cpu_communicator"
RUNNER = "vllm.model_executor.layers.fused_moe.runner.moe_runner"


def _offsets(sizes: list[int]) -> list[int]:
    out = [0]
    for size in sizes:
        out.append(out[-1] + size)
    return out


def all_gatherv(self, input_, dim: int = 0, sizes: list[int] | None = None):
    """Rank r contributes sizes[r] rows along `dim` (equal sizes when None); every rank gets them all in rank
    order. A list of tensors is gathered tensor by tensor and returned as a list."""
    if isinstance(input_, (list, tuple)):
        return [all_gatherv(self, tensor, dim, sizes) for tensor in input_]
    world = self.world_size
    if world == 1:
        return input_
    dim = dim % input_.dim()
    sizes = [input_.shape[dim]] * world if sizes is None else list(sizes)
    if len(sizes) != world or sizes[self.rank_in_group] != input_.shape[dim]:
        raise ValueError(f"all_gatherv: sizes {sizes} do not fit rank {self.rank_in_group}'s "
                         f"{tuple(input_.shape)} along dim {dim} in a group of {world}")
    rows = input_.movedim(dim, 0)
    largest = max(sizes)
    padded = torch.zeros((largest, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    padded[: rows.shape[0]] = rows
    gathered = torch.empty((world * largest, *rows.shape[1:]), dtype=rows.dtype, device=rows.device)
    dist.all_gather_into_tensor(gathered, padded, group=self.device_group)
    parts = [gathered[r * largest: r * largest + sizes[r]] for r in range(world)]
    return torch.cat(parts).movedim(0, dim).contiguous()


def reduce_scatterv(self, input_, dim: int = -1, sizes: list[int] | None = None):
    """The sum over ranks of `input_` (sum(sizes) rows along `dim`), of which this rank keeps its sizes[rank]."""
    world = self.world_size
    if world == 1:
        return input_
    dim = dim % input_.dim()
    total = input_.shape[dim]
    sizes = [total // world] * world if sizes is None else list(sizes)
    if len(sizes) != world or sum(sizes) != total:
        raise ValueError(f"reduce_scatterv: sizes {sizes} do not split {tuple(input_.shape)} along dim {dim} "
                         f"over a group of {world}")
    summed = input_.movedim(dim, 0).contiguous().clone()
    dist.all_reduce(summed, group=self.device_group)
    start = _offsets(sizes)[self.rank_in_group]
    return summed[start: start + sizes[self.rank_in_group]].movedim(0, dim).contiguous()


def _check_version() -> None:
    import vllm

    if vllm.__version__ != WRITTEN_FOR:
        raise RuntimeError(f"tests/support/cpu_gatherv.py was written against vLLM {WRITTEN_FOR}'s CPU communicator "
                           f"and MoE runner; this is vLLM {vllm.__version__}: read them again and update or drop the shim")


def _patch_communicator(module) -> None:
    _check_version()
    communicator = module.CpuCommunicator
    for name, function in (("all_gatherv", all_gatherv), ("reduce_scatterv", reduce_scatterv)):
        if name in communicator.__dict__:
            raise RuntimeError(f"this vLLM's CpuCommunicator has its own {name}: drop tests/support/cpu_gatherv.py")
        setattr(communicator, name, function)


def _patch_runner(module) -> None:
    """MoERunner picks the opaque custom op on the CPU too, as it does on a GPU."""
    _check_version()
    runner = module.MoERunner
    original = runner._select_forward

    def select_forward(self):
        chosen = original(self)
        if chosen is module._moe_forward:
            return torch.ops.vllm.moe_forward
        if chosen is module._moe_forward_shared:
            return torch.ops.vllm.moe_forward_shared
        raise RuntimeError(f"MoERunner._select_forward chose {chosen!r}, not the direct call this shim replaces")

    runner._select_forward = select_forward


PATCHES = {COMMUNICATOR: _patch_communicator, RUNNER: _patch_runner}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches each module of PATCHES right after it executes, in whichever process imports it."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        execute = loader.exec_module

        def exec_module(module):
            execute(module)
            PATCHES[fullname](module)

        loader.exec_module = exec_module
        return spec


def install() -> None:
    """Patch as soon as each target module is imported (before any process could have imported one)."""
    loaded = sorted(set(PATCHES) & set(sys.modules))
    if loaded:
        raise RuntimeError(f"install the CPU collectives shim before vLLM is imported; already loaded: {loaded}")
    if not any(isinstance(finder, _PatchOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


SITECUSTOMIZE_DIR = Path(__file__).with_name("dp_sitecustomize")


def serve_env() -> dict[str, str]:
    """PYTHONPATH for a `vllm serve` child with the shim in every process it starts (its sitecustomize)."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(SITECUSTOMIZE_DIR), os.environ.get("PYTHONPATH")]))}
