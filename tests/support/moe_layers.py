"""Shared pieces of the kernel tests: one MoE layer of mixed K, codebooks and tiers, its routing, the W_hat
read-back through a launcher, and the host-synchronisation net used by every no-sync test."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_expert_offload.exl3 import Exl3Linear, parse_linear
from vllm_expert_offload.exl3.decode import rotated_weight
from vllm_expert_offload.exl3.hadamard import hadamard_rows
from vllm_expert_offload.exl3.naming import PROJECTIONS
from vllm_expert_offload.kernels.contract import ExpertCrop, MoELayer
from vllm_expert_offload.kernels.expert_blocks import grouped_blocks
from vllm_expert_offload.kernels.matrix_table import matrix_table, own_addresses
from vllm_expert_offload.kernels.pointer_tables import build_pointer_tables, kernel_address, stack_scales
from vllm_expert_offload.kernels.rotated import MatmulBackend, RotatedMoE
from vllm_expert_offload.kernels.table_moe import TableMoE
from vllm_expert_offload.kernels.triton_dequantize import dequantize, split_fold
from vllm_expert_offload.memory import HostArena
from vllm_expert_offload.offload.tiers import host_record_bytes, place_expert

from .layers import make_layer

ALL_RATES = [(k, cb) for k in range(1, 9) for cb in ("3inst", "mcg", "mul1")] + [(k, "mul1") for k in (1.5, 2.5, 3.5)]
CPU = torch.device("cpu")
# The decode-once kernel's forms, (fold, split): plain, folded split, folded whole. A GPU compiles one variant per
# rate present for each form it is asked for, so a GPU check asks for the one form its device launches.
EVERY_FORM = ((False, False), (True, True), (True, False))


def device_fold_form(device: torch.device) -> tuple[tuple[bool, bool], ...]:
    """The folded form `device` launches, derived as the runtime derives it (triton_dequantize.split_fold)."""
    return ((True, split_fold(device)),)


def assert_dequantize_every_rate(dtype: torch.dtype, device: torch.device,
                                 forms: tuple[tuple[bool, bool], ...] = EVERY_FORM,
                                 rates: list[tuple[float, str]] = ALL_RATES) -> None:
    """The decode-once kernel over one mixed table of `rates` (by default every K and codebook; 128 x 256 each, two
    column pieces) on `device`, in each of `forms`: plain, bit-exact with exl3.decode's W_hat; folded (split or
    whole), H · W_hat (unnormalised) within the reference tolerance (fp16: one rounding); a matrix below `min_rows`
    (one more, in the middle, of the first rate: every rate asked for is decoded) is left untouched."""
    skip = len(rates) // 2
    rates = [*rates[:skip], rates[0], *rates[skip:]]
    layers = [parse_linear(make_layer(k, cb, 128, 256, seed=i), f"m{i}") for i, (k, cb) in enumerate(rates)]
    placed = [dataclasses.replace(layer, trellis=layer.trellis.to(device)) for layer in layers]
    table = matrix_table(placed, own_addresses(placed), device)
    counts = torch.full((len(layers),), 5, dtype=torch.int64, device=device)
    counts[skip] = 4  # below min_rows: not decoded
    stride = 128 * 256
    for fold, split in forms:
        out = torch.full((len(layers) * stride,), float("nan"), dtype=dtype, device=device)
        dequantize(table, out, counts=counts, min_rows=5, chunk=len(layers), matrix_stride=stride, fold=fold,
                   split=split)
        got = out.view(len(layers), 128, 256).cpu()
        assert got[skip].isnan().all()
        for i, layer in enumerate(layers):
            if i == skip:
                continue
            w_hat = rotated_weight(layer)
            if not fold:
                assert torch.equal(got[i], w_hat.to(dtype)), (rates[i], fold)
                continue
            want = hadamard_rows(w_hat.float()) * 128**0.5
            if dtype == torch.float32:
                assert_close_to_reference(got[i], want)
            else:
                torch.testing.assert_close(got[i].float(), want, rtol=1e-3, atol=1e-3 * float(want.abs().max()),
                                           msg=lambda m: f"{rates[i]} split={split}: {m}")


def decode_with_kernel(layers: list[Exl3Linear], backend: MatmulBackend) -> list[torch.Tensor]:
    """W_hat of each matrix, read back by multiplying identity rows through one launch over all of them."""
    size_k = layers[0].in_features
    table = matrix_table(layers, own_addresses(layers), CPU)
    eye = torch.eye(size_k).repeat(len(layers), 1)
    matrix_of_row = torch.arange(len(layers)).repeat_interleave(size_k)
    out = torch.full((eye.shape[0], table.out_features), float("nan"))
    backend.launch(eye, *grouped_blocks(matrix_of_row, len(layers), backend.block_m), table, out)
    return list(out.split(size_k))


HIDDEN, INTERMEDIATE = 128, 256
TIERS = (True, False, True, False, False, True)  # GPU tier (registry addresses) or host arena, interleaved
# The experts' rates, cycled over experts and projections. A compiled kernel decodes each rate its table holds (one
# branch per rate and codebook), so GPU tests not about mixed rates take UNIFORM, and the mixed-rate one TWO_RATES;
# the interpreter's tests (nothing compiled) take every class at once.
RATES = [(3, "mul1"), (2.5, "mul1"), (4, "mcg"), (2, "3inst"), (3, "mul1"), (5, "mul1")]
UNIFORM = [(3, "mul1")]
TWO_RATES = [(3, "mul1"), (2, "3inst")]


def expert_sets(seed: int, hidden: int = HIDDEN, intermediate: int = INTERMEDIATE,
                rates: list[tuple[float, str]] = RATES) -> list[dict[str, Exl3Linear]]:
    """K and codebooks from `rates` across experts and across the three projections of one expert."""
    shapes = {"gate": (hidden, intermediate), "up": (hidden, intermediate), "down": (intermediate, hidden)}
    sets = []
    for e, _ in enumerate(TIERS):
        sets.append({
            p: parse_linear(make_layer(*rates[(e + i) % len(rates)], *shapes[p], seed=100 * seed + 10 * e + i),
                            f"experts.{e}.{p}")
            for i, p in enumerate(PROJECTIONS)
        })
    return sets


def placed_moe(
    crop: ExpertCrop, backend: MatmulBackend | Callable[[MoELayer], object], swiglu_limit: float | None = None,
    seed: int = 0, device: torch.device = CPU, hidden: int = HIDDEN, intermediate: int = INTERMEDIATE,
    rates: list[tuple[float, str]] = RATES,
):
    """(torch reference, kernel under test, arena) over one layer of `rates`; on CUDA the host tier is the mapped
    arena. `backend`: a launcher for the shared glue (RotatedMoE), or what builds a kernel from the MoELayer
    (top-k 2)."""
    sets = expert_sets(seed, hidden, intermediate, rates)
    arena = HostArena(sum(host_record_bytes(s) for s, gpu in zip(sets, TIERS) if not gpu), device=device)
    placed = [place_expert(s, gpu, arena, device) for s, gpu in zip(sets, TIERS)]
    experts, scales = stack_scales(placed, device)
    tables = build_pointer_tables(experts, kernel_address(arena, device), device)
    reference = TableMoE(experts, tables, arena, crop, torch.float32, device, swiglu_limit)
    if isinstance(backend, MatmulBackend):
        kernel = RotatedMoE(experts, tables, scales, arena, crop, device, backend, swiglu_limit)
    else:
        kernel = backend(MoELayer(experts, tables, scales, arena, crop, torch.float32, device, swiglu_limit, top_k=2,
                                  capture_rows=(64,)))  # graph tests capture up to 64 tokens
    return reference, kernel, arena


def routing(tokens: int, seed: int, device: torch.device = CPU,
            hidden: int = HIDDEN) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.stack([torch.randperm(len(TIERS), generator=gen)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=gen)
    return x.to(device), weights.to(device), ids.to(device)


FULL = ExpertCrop(HIDDEN, INTERMEDIATE, 0)


def other_ranks_slots(ids: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids with -1, expert parallelism's "another rank's expert", on every third slot and on all of token 0's;
    the ids and weights a reference computes the same sum from: those slots on expert 0 with weight 0). The
    kernel under test keeps its nonzero weights on the -1 slots: they must add nothing anyway."""
    marked = ids.clone()
    marked.view(-1)[::3] = -1
    marked[0] = -1
    return marked, torch.where(marked >= 0, marked, 0), torch.where(marked >= 0, weights, 0)


def assert_close_to_reference(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32 on both sides, in a different order (rotated basis vs dequantized weights); the random scales make
    large terms that cancel, so the tolerance is relative to the output's magnitude."""
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


class NoHostSync(TorchDispatchMode):
    """Fails on every op whose result shape or control flow needs the device's data on the host, and on any
    copy from a device to the host: in a CUDA graph these either break capture or freeze one batch's values.

    The second net behind the meta-device proof (meta_proof.py): it sees only what reaches the dispatcher by a
    name it knows, so `.tolist()`, `.numpy()` and copies into host tensors slip through it; the proof does not."""

    FORBIDDEN = ("aten::nonzero", "aten::unique", "aten::_unique", "aten::unique_dim", "aten::unique_consecutive",
                 "aten::_local_scalar_dense", "aten::masked_select", "aten::item", "aten::bincount")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith(self.FORBIDDEN):
            raise AssertionError(f"host synchronisation: {name}")
        if name == "aten::repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor") and (
                kwargs or {}).get("output_size") is None:
            raise AssertionError(f"host synchronisation: {name} without output_size")
        if name in ("aten::index", "aten::index_put", "aten::index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] or ()):
            raise AssertionError(f"host synchronisation: {name} with a boolean mask")
        if name in ("aten::_to_copy", "aten::copy_", "aten::to"):
            tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
            target = (kwargs or {}).get("device")
            sources = {t.device.type for t in tensors}
            if "cpu" in {getattr(target, "type", target)} and sources - {"cpu"}:
                raise AssertionError(f"device-to-host copy: {name}")
        return func(*args, **(kwargs or {}))
