"""Run by test_wheel_install.py in a child interpreter whose PYTHONPATH is only the wheel's install target: imports
every shipped module from there, calls the plugin entry point, and runs the compiled CPU kernel against the torch
decoder. Prints one JSON report on stdout; the test judges it."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import sys
from pathlib import Path

target = Path(sys.argv[1]).resolve()
package_dir = target / "vllm_expert_offload"
report: dict[str, object] = {}

import vllm_expert_offload  # noqa: E402

report["package_file"] = vllm_expert_offload.__file__
# Found by walking the files, not pkgutil.walk_packages: that imports every package it passes, testing/ included.
modules = sorted(
    ".".join(("vllm_expert_offload", *path.relative_to(package_dir).with_suffix("").parts)).removesuffix(".__init__")
    for path in package_dir.rglob("*.py") if path.relative_to(package_dir).parts[0] != "testing")
for name in modules:
    importlib.import_module(name)
(installed,) = importlib.metadata.distributions(path=[str(target)])
(plugin,) = [ep for ep in installed.entry_points if ep.group == "vllm.general_plugins"]
plugin.load()()  # vLLM calls it in every process
loaded = {name: getattr(module, "__file__", None) for name, module in sys.modules.items()
          if name.startswith("vllm_expert_offload")}
report["modules_imported"] = modules
report["testing_modules_loaded"] = sorted(name for name in loaded if name.startswith("vllm_expert_offload.testing"))
report["loaded_outside_target"] = sorted(f"{name}: {file}" for name, file in loaded.items()
                                         if file is not None and not Path(file).resolve().is_relative_to(target))

import torch  # noqa: E402

from vllm_expert_offload.exl3 import Codebook, Exl3Linear  # noqa: E402
from vllm_expert_offload.exl3.decode import rotated_weight  # noqa: E402
from vllm_expert_offload.kernels import cpu_exl3, cpu_extension  # noqa: E402
from vllm_expert_offload.kernels.expert_blocks import single_matrix_blocks  # noqa: E402
from vllm_expert_offload.kernels.matrix_table import matrix_table, own_addresses  # noqa: E402

report["kernel_sources"] = [str(path) for path in cpu_exl3.EXTENSION.sources]
report["cpu_kernel_unavailable"] = cpu_exl3.cpu_kernel_unavailable()
if report["cpu_kernel_unavailable"] is None:
    report["build_directory"] = str(cpu_extension.build_directory(cpu_exl3.EXTENSION))
    # Identity rows through the kernel give W_hat itself, which the torch decoder computes bit-exactly.
    gen = torch.Generator().manual_seed(0)
    size_k, size_n, k = 128, 64, 3
    trellis = torch.randint(-(1 << 15), 1 << 15, (size_k // 16, size_n // 16, 16 * k), generator=gen,
                            dtype=torch.int16)
    layer = Exl3Linear("check", trellis, torch.ones(size_k).half(), torch.ones(size_n).half(), Codebook.MUL1, k)
    table = matrix_table([layer], own_addresses([layer]), "cpu")
    out = torch.full((size_k, size_n), float("nan"))
    cpu_exl3.CPU_MATMUL.launch(torch.eye(size_k), *single_matrix_blocks(size_k, cpu_exl3.BLOCK_M, torch.device("cpu")),
                               table, out)
    expected = rotated_weight(layer).float()
    report["kernel_library"] = cpu_exl3.extension().__file__
    report["kernel_matches_torch_decoder"] = bool(torch.equal(out, expected))
    report["kernel_output_nonzero"] = bool(expected.abs().sum() > 0)
print(json.dumps(report))
