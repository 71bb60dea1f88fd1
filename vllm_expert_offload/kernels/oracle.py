"""The one place that decides which backend computes EXL3 layers; layer code never branches on hardware.

`expert_offload.kernel` asks for a backend: "auto" (default) or one of the registry's names. The registry lists
the backends in priority order, each a module exporting a `Backend` (kernels/contract.py); adding one is that
module plus one line here.
- auto: the backends `auto` considers on this device type, in order; the first that can run computes every layer,
  and where it refuses a layer (exllamav3's kernels have constraints) the next one that can run takes that layer.
  So on CUDA: exllamav3 where its compiled extension imports, Triton for the layers it refuses, else Triton, else
  the torch reference; on a CPU: the compiled CPU kernel, else the torch reference. Each backend passed over is
  named with its reason in the one log line.
- A backend asked for by name that cannot run here is refused at startup with the reason, never replaced; so is
  a layer it cannot compute (when its weights are placed).
The decision is made once per process and logged in one line with its reasons.

Backends (their modules say more):
- exllamav3 (exllamav3_backend.py): exllamav3 1.6.5's compiled CUDA kernels over our pointer tables.
- triton (triton_exl3.py): the Triton kernel over the pointer tables (CUDA, or the interpreter on a CPU with
  TRITON_INTERPRET=1); no host sync, CUDA-graph safe.
- cpu (cpu_exl3.py): the compiled CPU kernel (the package's csrc/), every trellis read in place: the CPU production path.
- torch (table_moe.py): the reference; decodes per batch (host syncs: needs --enforce-eager where vLLM captures
  CUDA graphs); its dense linears are decoded once at load ("dequantized"), which `dequantize_linears` also asks
  for with any backend.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass

import torch

from ..errors import ExpertOffloadError
from ..offload.options import BACKENDS
from .contract import Backend, LinearKernel, LinearLayer, MoEKernel, MoELayer

logger = logging.getLogger("vllm.expert_offload")
# Priority order, and the module of each (imported only when asked about: triton, the C++ build).
REGISTRY = (("exllamav3", "exllamav3_backend"), ("triton", "triton_exl3"), ("cpu", "cpu_exl3"), ("torch", "table_moe"))
DEQUANTIZED = "dequantized"  # dense linears decoded once at load (the torch backend's linears)


class BackendUnavailable(ExpertOffloadError, RuntimeError):
    pass


@dataclass(frozen=True)
class KernelChoice:
    moe: str  # backend for routed experts
    linear: str  # backend for dense EXL3 linears ("dequantized" = decoded once at load)
    reason: str
    fallback: str | None = None  # auto: the backend of a layer the first one refuses
    graph_safe: bool = True  # every backend the choice can use makes no host sync (CUDA-graph capture)


def backend(name: str) -> Backend:
    """The registered backend `name` (its module imported now); ImportError when its module cannot import."""
    module = dict(REGISTRY)[name]
    return importlib.import_module(f"{__package__}.{module}").BACKEND


def why_unavailable(name: str, device: torch.device) -> str | None:
    """None when backend `name` can run on `device`, else why not (a module that does not import says so)."""
    try:
        found = backend(name)
    except ImportError as exc:
        return f"{name} does not import ({exc})"
    return found.unavailable(device)


def choose_kernels(requested: str, device: torch.device, dequantize_linears: bool = False) -> KernelChoice:
    """The backend for each layer kind on `device`, or BackendUnavailable naming the option and the reason."""
    if requested not in BACKENDS:
        raise BackendUnavailable(f"--additional-config expert_offload.kernel={requested!r}: expected one of {BACKENDS}")
    if requested == "auto":
        moe, fallback, reason = _auto(device)
    else:
        refusal = why_unavailable(requested, device)
        if refusal is not None:
            raise BackendUnavailable(f"--additional-config expert_offload.kernel={requested!r} cannot run: {refusal}")
        moe, fallback, reason = requested, None, "asked for by expert_offload.kernel"
    if moe == "torch" or dequantize_linears:
        linear = DEQUANTIZED
        reason += "; dense linears decoded once at load" + (" (dequantize_linears)" if dequantize_linears else "")
    else:
        linear = moe
    graph_safe = all(backend(name).graph_safe for name in (moe, fallback) if name is not None)
    return KernelChoice(moe, linear, reason, fallback, graph_safe)


def _auto(device: torch.device) -> tuple[str, str | None, str]:
    """(backend, the one for layers it refuses, reason): the registry's order on this device type."""
    chain, passed_over = [], []
    for name, _ in REGISTRY:
        try:
            candidate = backend(name)
        except ImportError as exc:
            passed_over.append(f"{name} passed over ({name} does not import ({exc}))")
            continue
        if device.type not in candidate.auto_on:
            continue
        why_not = candidate.unavailable(device)
        if why_not is not None:
            passed_over.append(f"{name} passed over ({why_not})")
            continue
        chain.append(candidate)
        if not candidate.refuses_layers:
            break  # it computes every layer: nothing after it is ever used
    if not chain:
        raise BackendUnavailable(f"no EXL3 backend can run on {device}: {'; '.join(passed_over)}")
    first, fallback = chain[0], (chain[1] if len(chain) > 1 else None)
    reason = f"{device.type}: {first.name}, {first.description}"
    if fallback is not None:
        reason += f", {fallback.name} for MoE layers its kernels refuse"
    reason = "; ".join([reason, *passed_over])
    return first.name, None if fallback is None else fallback.name, reason


def log_choice(choice: KernelChoice) -> None:
    logger.info("EXL3 kernels: routed experts -> %s, dense linears -> %s (%s)", choice.moe, choice.linear, choice.reason)


def build_moe_kernel(choice: KernelChoice, layer: MoELayer) -> MoEKernel:
    """The first backend of the choice that computes this layer builds its kernel."""
    return _build(_chain(choice.moe, choice.fallback), layer, "MoE layers", lambda b: b.moe_refusal, lambda b: b.build_moe)


def build_linear_kernel(choice: KernelChoice, layer: LinearLayer) -> LinearKernel:
    """The dense linear's kernel: the choice's linear backend, or the fallback where it refuses this layer."""
    first = "torch" if choice.linear == DEQUANTIZED else choice.linear
    chain = _chain(first, None if first == "torch" else choice.fallback)
    return _build(chain, layer, "dense linears", lambda b: b.linear_refusal, lambda b: b.build_linear)


def _chain(first: str, fallback: str | None) -> list[str]:
    return [first] if fallback is None else [first, fallback]


def _build(chain: list[str], layer: MoELayer | LinearLayer, kind: str, refusal_of, builder_of):
    """Walk `chain`: the first backend that does not refuse `layer` builds it; with one backend in the chain (asked
    for by name, or one that refuses nothing) a refusal is an error naming the layer and why."""
    refusals = []
    for name in chain:
        chosen = backend(name)
        refusal = refusal_of(chosen)(layer)
        if refusal is None:
            if refusals:
                _log_once(f"EXL3 kernels: {kind} like {layer.name} -> {name} ({refusals[0]})")
            return builder_of(chosen)(layer)
        refusals.append(f"{name}: {refusal}")
    if len(chain) == 1:
        raise BackendUnavailable(f"--additional-config expert_offload.kernel={chain[0]!r} cannot compute "
                                 f"{layer.name}: {refusals[0].split(': ', 1)[1]}")
    raise BackendUnavailable(f"no EXL3 backend can compute {layer.name}: {'; '.join(refusals)}")


@functools.cache
def _log_once(message: str) -> None:
    logger.info(message)
