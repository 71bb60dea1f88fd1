"""Where vLLM's compiled graph finds each EXL3 layer at run time: the engine's static forward context.

Each EXL3 layer's forward is one op of kernels/ops.py that names its layer (`<module prefix>.exl3`). The method
registers itself under that name in `compilation_config.static_forward_context`, as vLLM's own layers (and
LoRA's linear op) do; vLLM hands that dict to every forward as `forward_context.no_compile_layers`, so a name
in a graph resolves to this engine's layer even with two engines in one process or a graph from vLLM's compile
cache. Outside a forward (tests, benchmarks) the ops keep their own registry. Checked against vLLM 0.32, 0.33.
"""

from __future__ import annotations

from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context, is_forward_context_available

from ...kernels import ops
from ..patching import HookError

SUFFIX = ".exl3"


def _resolve(name: str) -> object:
    if is_forward_context_available():
        return get_forward_context().no_compile_layers[name]
    return ops.resolve_registered(name)


def register_op_target(module_prefix: str, target: object) -> str:
    """Register `target` (an EXL3 method) for the module `module_prefix`; returns the name its op carries."""
    name = module_prefix + SUFFIX
    context = get_current_vllm_config().compilation_config.static_forward_context
    if name in context:
        raise HookError(f"duplicate EXL3 layer name {name!r} in vLLM's static forward context")
    context[name] = target
    ops.set_resolver(_resolve)
    return name
