"""What the GPU check runs imports on a machine without vLLM (the lent GPU machine has none), checked here with vLLM
made unimportable by a sys.meta_path blocker in a child interpreter. Which modules pull vLLM in: only those under
integration/ (and testing's engine helpers): the kernels and the offload core read no vLLM state (the profiling flag
lives in offload/phase.py, capture sizes are handed down), and the package's register() imports the plugin only when
vLLM calls it."""

from __future__ import annotations

import subprocess
import sys

from support.paths import REPO

BLOCKER = """
import sys

class NoVllm:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r} (vLLM is not installed on the GPU machine)")
        return None

sys.meta_path.insert(0, NoVllm())
sys.path.insert(0, "tests")
"""
# Everything scripts/gpu-check.sh imports before the engine steps: its step budgets, the CPU tier's extension build, the
# kernels and memory tiers, the benchmarks, the GPU tests (with their helpers), the CLI's topology command.
MODULES = ("vllm_expert_offload", "vllm_expert_offload.kernels.oracle", "vllm_expert_offload.kernels.ops", "vllm_expert_offload.kernels.triton_exl3",
           "vllm_expert_offload.kernels.exllamav3_backend", "vllm_expert_offload.memory",
           "vllm_expert_offload.tools.random_layers", "vllm_expert_offload.cli", "vllm_expert_offload.tools.topology_cmd",
           "vllm_expert_offload.tools.gpu_check_budget", "vllm_expert_offload.tools.cpu_kernel_build",
           "support.moe_layers")
FILES = ("benchmarks/gpu_bandwidth_probe.py", "benchmarks/bench_gpu_kernels.py", "tests/kernels/test_triton_gpu.py",
         "tests/kernels/test_exllamav3_gpu.py", "tests/kernels/test_compiled_gpu.py", "tests/memory/test_arena.py",
         "tests/kernels/test_pointer_tables.py", "tests/kernels/test_stream_host_tier.py")


def _run(code: str) -> subprocess.CompletedProcess:
    env_code = BLOCKER + code
    return subprocess.run([sys.executable, "-c", env_code], cwd=REPO, capture_output=True, text=True, timeout=240)


def test_what_the_gpu_check_runs_imports_and_runs_its_lazy_paths_without_vllm() -> None:
    result = _run(f"""
import importlib, importlib.util
for name in {MODULES!r}:
    importlib.import_module(name)
for path in {FILES!r}:
    spec = importlib.util.spec_from_file_location(path.replace("/", "_")[:-3], path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
from vllm_expert_offload.offload.phase import PHASE
assert PHASE.profiling is False  # read in every exllamav3 forward
assert "vllm" not in sys.modules
print("imported")
""")
    assert result.returncode == 0 and result.stdout.strip() == "imported", result.stderr[-3000:]


def test_the_blocker_blocks_what_needs_vllm() -> None:
    """Negative control: the plugin's registration (what vLLM's entry point calls) and its quant-config module do
    need vLLM and fail under the blocker, so the test above means something."""
    for code in ("import vllm_expert_offload; vllm_expert_offload.register()",
                 "import vllm_expert_offload.integration.methods.quant_config"):
        result = _run(code)
        assert result.returncode != 0 and "vLLM is not installed on the GPU machine" in result.stderr, code
