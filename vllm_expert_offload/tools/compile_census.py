"""The compile census (`bench-kernels --census`): which Triton kernel variants the backend compiles when vLLM starts,
how long compiling them ahead of time takes here, and each variant's shared memory against each target's limit.

Triton compiles a kernel once per specialisation: its constexpr arguments, num_warps/num_stages, and each runtime
argument's type and class (an int equal to 1 becomes a constant, a multiple of 16 or a 16-byte-aligned pointer gets a
divisibility hint: Triton's own `native_specialize_impl`). vLLM runs a MoE layer at its profile run and at every
CUDA-graph capture size, so each distinct key met there is one compile per worker at startup. The census drives the
backend's real forwards on a layer whose tensors are all on `meta` (shapes without data: the launchers' host-side
decisions depend on shapes only) with every Triton launch recorded instead of run, and keys each launch as Triton's
JIT cache would. Recorded variants are compiled with tools/static_kernels.py (full compiles for the time, LLVM IR
only for the shared memory), on no GPU.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..exl3 import Codebook, Exl3Linear
from ..exl3.naming import PROJECTIONS
from ..kernels.contract import ExpertCrop, MoELayer
from ..kernels.launch_ops import LAUNCH_OPS
from ..kernels.pointer_tables import build_pointer_tables, kernel_address, stack_scales
from ..kernels.static_spec import StaticKernel
from ..kernels.triton_fused import SHARED_PER_BLOCK, SM_COUNT
from ..kernels.triton_moe import decode_split, fused_moe
from ..offload.tiers import place_expert
from .json_child import run_json

META = torch.device("meta")
# vLLM 0.32/0.33's default capture sizes (config/vllm.py, max_num_seqs 256: at most 512 tokens) and the profile
# run's batch (max_num_batched_tokens 8192): every batch size a MoE layer meets before serving.
VLLM_CAPTURE_SIZES = (1, 2, 4, *range(8, 256, 8), *range(256, 513, 16))
PROFILE_TOKENS = 8192


@dataclass(frozen=True)
class CensusLayer:
    """One MoE layer the census starts: this rank's widths, the experts' rates (one (K, codebook) per expert, its
    three projections alike), top-k and the activation dtype vLLM runs the model in."""

    model: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    rates: tuple[tuple[float, str], ...]  # cycled over the experts
    dtype: str = "bf16"


LAYERS = (
    CensusLayer("Qwen3-30B-A3B", 2048, 768, 128, 8, ((3.0, "mul1"),)),
    CensusLayer("DeepSeek-V4.1-Flash-TP2", 5120, 1152, 384, 6, ((3.0, "mul1"),)),
    CensusLayer("Qwen3-30B-A3B-mixed-K", 2048, 768, 128, 8, ((2.0, "mul1"), (3.0, "mul1"), (4.0, "mul1"))),
)
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def meta_layer(layer: CensusLayer) -> MoELayer:
    """`layer` with every tensor on meta: experts (GPU tier), scale stacks, pointer tables."""
    shapes = {"gate": (layer.hidden, layer.intermediate), "up": (layer.hidden, layer.intermediate),
              "down": (layer.intermediate, layer.hidden)}
    sets = []
    for e in range(layer.experts):
        k, codebook = layer.rates[e % len(layer.rates)]
        sets.append({p: Exl3Linear(
            f"experts.{e}.{p}", torch.empty(rows // 16, cols // 16, int(16 * k), dtype=torch.int16, device=META),
            torch.empty(rows, dtype=torch.float16, device=META), torch.empty(cols, dtype=torch.float16, device=META),
            Codebook(codebook), k) for p, (rows, cols) in shapes.items()})
    placed = [place_expert(s, True, None, META) for s in sets]
    experts, scales = stack_scales(placed, META)
    tables = build_pointer_tables(experts, kernel_address(None, META), META)
    return MoELayer(experts, tables, scales, None, ExpertCrop(layer.hidden, layer.intermediate, 0),
                    _DTYPES[layer.dtype], META, top_k=layer.top_k)


_JIT: dict[int, object] = {}


def as_jit(fn):
    """The JITFunction of a kernel: itself, or under Triton's interpreter the one its InterpretedFunction wraps
    (built from the same function and jit options, for its parameters' specialisation flags)."""
    from triton.runtime.jit import JITFunction

    if isinstance(fn, JITFunction):
        return fn
    if id(fn) not in _JIT:
        _JIT[id(fn)] = JITFunction(fn.fn, **fn.kwargs)
    return _JIT[id(fn)]


def launch_key(fn, args: tuple, kwargs: dict) -> tuple:
    """What Triton's JIT cache keys this launch by: each parameter's (type, specialisation) from Triton's own
    `native_specialize_impl` (constexprs by value), and the launch options."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    fn = as_jit(fn)
    bound = dict(zip(fn.arg_names, args)) | kwargs
    key = []
    for param in fn.params:
        value = bound.get(param.name, param.default)
        if param.is_constexpr:
            key.append((param.name, "constexpr", value))
        else:
            kind, spec = native_specialize_impl(CUDABackend, value, param.is_const, not param.do_not_specialize,
                                                not param.do_not_specialize_on_alignment)
            key.append((param.name, kind, spec))
    return fn.__name__, tuple(key), kwargs.get("num_warps", 4), kwargs.get("num_stages", 3)


class _LaunchOnMeta(TorchDispatchMode):
    """Calls each launch op's launcher (kernels/launch_ops.py) on its meta tensors, where the op itself does
    nothing: the launcher computes the grid and arguments and reaches Triton's `run`, which records."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        launcher = LAUNCH_OPS.get(str(func.overloadpacket._qualified_op_name))
        if launcher is not None:
            return launcher(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


@contextmanager
def recorded_launches() -> Iterator[dict[tuple, object]]:
    """Every Triton launch while inside, keyed by `launch_key` (key -> the jit function), none of them run."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    seen: dict[tuple, object] = {}

    def record(self, *args, grid, warmup, **kwargs):
        seen.setdefault(launch_key(self, args, kwargs), as_jit(self))

    with mock.patch.object(JITFunction, "run", record), mock.patch.object(InterpretedFunction, "run", record), \
            _LaunchOnMeta():
        yield seen


def static_kernel(key: tuple, fn) -> StaticKernel:
    """A recorded variant as tools/static_kernels.py compiles it: runtime types, constants, 16-aligned arguments."""
    name, params, num_warps, num_stages = key
    signature, constexprs, aligned = {}, {}, []
    for param, kind, spec in params:
        if kind == "constexpr":
            constexprs[param] = spec
        else:
            signature[param] = kind
            if spec == "D":
                aligned.append(param)
    return StaticKernel(name, fn, signature | {p: "constexpr" for p in constexprs}, constexprs, num_warps, num_stages,
                        0, None, aligned=tuple(aligned))


def layer_variants(layer: CensusLayer, capability: int, tokens: tuple[int, ...]) -> dict[tuple, object]:
    """The distinct variants of `layer`'s forwards at each of `tokens` on `capability` (its decode split, shared
    memory limit and fold form), keyed by `launch_key`."""
    from ..kernels import triton_dequantize, triton_moe

    moe = meta_layer(layer)
    split = decode_split(layer.hidden, layer.intermediate, layer.hidden, layer.top_k, 2 * SM_COUNT[capability])
    # What the launchers ask of the device: its shared memory per block, and its fold form (on meta, the split one)
    with mock.patch.object(triton_moe, "shared_per_block", lambda device: SHARED_PER_BLOCK[capability]), \
            mock.patch.object(triton_dequantize, "split_fold",
                              lambda device: triton_dequantize.split_fold_for(capability)):
        kernel = fused_moe(moe, split)
        with recorded_launches() as seen:
            for n in tokens:
                x = torch.empty(n, layer.hidden, dtype=_DTYPES[layer.dtype], device=META)
                weights = torch.empty(n, layer.top_k, dtype=torch.float32, device=META)
                ids = torch.empty(n, layer.top_k, dtype=torch.int64, device=META)
                kernel.forward(x, weights, ids, False)
    return dict(seen)


def census(layers: tuple[CensusLayer, ...] = LAYERS, tokens: tuple[int, ...] = (*VLLM_CAPTURE_SIZES, PROFILE_TOKENS),
           compile_variants: Callable[[StaticKernel, int], dict] | None = None) -> dict:
    """Per target and layer: the variants' count and count by kernel, and with `compile_variants` (variant, capability
    -> facts) their total compile seconds, largest shared memory against the target's limit and each variant's
    facts; each stamped with the Triton that specialised them (its version: the count is its launch keys) and the
    ptxas that compiled them (tools/static_kernels.toolchain). In-process (under Triton's interpreter too, when
    nothing is compiled)."""
    from .static_kernels import toolchain

    out = {}
    for target, capability in (("sm_90", 90), ("sm_120", 120)):
        per_layer = {}
        stamp = toolchain(capability)
        if compile_variants is None:
            del stamp["ptxas"]  # nothing compiled
        for layer in layers:
            variants = layer_variants(layer, capability, tokens)
            by_kernel: dict[str, int] = {}
            for key in variants:
                by_kernel[key[0]] = by_kernel.get(key[0], 0) + 1
            entry = {"count": len(variants), "by_kernel": by_kernel, "toolchain": stamp}
            if compile_variants is not None:
                facts = [compile_variants(static_kernel(key, fn), capability) for key, fn in variants.items()]
                entry["compile_s"] = round(sum(f["seconds"] for f in facts), 1)
                entry["shared_bytes_max"] = max(f["shared_bytes"] for f in facts)
                entry["shared_limit"] = SHARED_PER_BLOCK[capability]
                entry["variants_over_limit"] = sum(f["shared_bytes"] > SHARED_PER_BLOCK[capability] for f in facts)
                entry["variants"] = {f"{key[0]}#{i}": {"shared_bytes": f["shared_bytes"], "spills": f["spills"],
                                                       "registers": f["registers"], "seconds": round(f["seconds"], 1)}
                                     for i, (key, f) in enumerate(zip(variants, facts))}
            per_layer[layer.model] = entry
        out[target] = per_layer
    return out


def timed_compile(kernel: StaticKernel, capability: int) -> dict:
    """Full ahead-of-time compile (PTX and cubin, as at a worker's startup): seconds and shared bytes."""
    from .static_kernels import compile_kernel, ptxas_usage

    start = time.perf_counter()
    compiled = compile_kernel(kernel, capability)
    seconds = time.perf_counter() - start
    print(f"compiled {kernel.name} for sm_{capability} in {seconds:.1f} s", file=sys.stderr, flush=True)
    return {"seconds": seconds, "shared_bytes": compiled.shared_bytes, **ptxas_usage(compiled)}


def census_report(layers: tuple[CensusLayer, ...] = LAYERS, compile_variants: bool = True) -> dict:
    """`census` in a child Python with Triton's compiler (no interpreter), compiling every variant when asked."""
    return run_json(__name__, [json.dumps([asdict(layer) for layer in layers]), str(int(compile_variants))],
                    triton_interpret=False)


if __name__ == "__main__":
    _layers = tuple(CensusLayer(**{**d, "rates": tuple(tuple(r) for r in d["rates"])}) for d in json.loads(sys.argv[1]))
    print(json.dumps(census(_layers, compile_variants=timed_compile if sys.argv[2] == "1" else None)))
