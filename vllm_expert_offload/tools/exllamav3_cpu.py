"""exllamav3 1.6.5's CPU MoE (exllamav3_ext/cpu/moe_mul1.cpp) as a scratch extension, for side-by-side speed.

Why here: issue #41's anchor is that kernel, and a figure measured on another machine says nothing about ours, so
`bench-kernels` and benchmarks/bench_cpu_moe_vs_exllamav3.py run it in the same process on the same experts. It is
never vendored: `build_exllamav3` downloads the wheel with pip and compiles moe_mul1.cpp with a minimal binding
into a directory of the caller's choosing (about 5 minutes on 2 cores); `exllamav3_from` loads an earlier build.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import torch

from ..exl3.naming import PROJECTIONS

ENV = "VLLM_EXPERT_OFFLOAD_EXL3_CPU_SCRATCH_EXT"  # path of an earlier build's exl3cpu_scratch.so


EXLLAMAV3 = "exllamav3==1.6.5"
BINDING = """#include <torch/extension.h>
#include "moe_mul1.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("make_layer", &exl3_moe_cpu_make_layer);
    m.def("free_layer", &exl3_moe_cpu_free_layer);
    m.def("forward", &exl3_moe_cpu_forward, py::call_guard<py::gil_scoped_release>());
    m.def("swizzle_group", &exl3_moe_cpu_swizzle_group);
    m.def("planar_layout", &exl3_moe_cpu_planar_layout);
    m.def("has_avx512_vnni", &exl3_moe_cpu_has_avx512_vnni);
    m.def("has_avx2", &exl3_moe_cpu_has_avx2);
}
"""


def build_exllamav3(directory: Path) -> Path:
    """Download exllamav3 1.6.5 (no deps) and compile its CPU MoE with a minimal binding; the .so's path."""
    from torch.utils.cpp_extension import load

    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", EXLLAMAV3, "-d", str(directory)], check=True)
    wheel = next(directory.glob("exllamav3-1.6.5-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(directory / "src", [n for n in archive.namelist() if "exllamav3_ext/cpu/" in n])
    source = next((directory / "src").rglob("exllamav3_ext/cpu"))
    (directory / "bind.cpp").write_text(BINDING)
    (directory / "build").mkdir(exist_ok=True)
    load(name="exl3cpu_scratch", sources=[str(directory / "bind.cpp"), str(source / "moe_mul1.cpp")],
         extra_include_paths=[str(source)], extra_cflags=["-O3"], build_directory=str(directory / "build"))
    return directory / "build" / "exl3cpu_scratch.so"


def load_exllamav3(path: Path):
    """The scratch module at `path` (a torch extension: torch is imported first, which it links against)."""
    loader = importlib.machinery.ExtensionFileLoader("exl3cpu_scratch", str(path))
    spec = importlib.util.spec_from_loader("exl3cpu_scratch", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def packed_trellis(trellis: torch.Tensor, group: int, planar: int) -> torch.Tensor:
    """A (k/16, n/16, 16K) trellis in exllamav3's packed CPU layout, as moe_mul1.h documents it: tile (kt, nt) at
    (nt / group, kt, nt % group); with planar, dword w of a tile at 8 * (w % bits) + w / bits."""
    if not group:
        return trellis.contiguous()
    tiles_k, tiles_n, per_tile = trellis.shape
    banded = trellis.reshape(tiles_k, tiles_n // group, group, per_tile).permute(1, 0, 2, 3)
    if planar:
        dwords = banded.contiguous().view(torch.int32).reshape(tiles_n // group, tiles_k, group, 8, per_tile // 16)
        return dwords.transpose(3, 4).contiguous().view(torch.int16).reshape(tiles_k, tiles_n, per_tile)
    return banded.contiguous().reshape(tiles_k, tiles_n, per_tile)


class Exllamav3Layer:
    """The same experts registered with exllamav3's CPU MoE (silu gate, no biases)."""

    def __init__(self, module, sets: list[dict], k: int, threads: int) -> None:
        self.module, self.threads = module, threads
        self.affinity = os.sched_getaffinity(0)
        group, planar = module.swizzle_group(float(k)), module.planar_layout(float(k))
        lists = []
        for p in PROJECTIONS:
            lists.append([packed_trellis(s[p].trellis, group, planar) for s in sets])
            lists.append([s[p].suh.contiguous() for s in sets])
            lists.append([s[p].svh.contiguous() for s in sets])
        self.keep = lists
        self.handle = module.make_layer(*lists, [], [], [], 0, 0.0, 1 if group else 0)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """exllamav3's forward as it runs: its pool runs the caller as worker 0 and pins it to the first core on
        every call (in its own worker process that thread is its own); `release_caller` undoes that."""
        out = torch.empty(x.shape, dtype=torch.float32)
        self.module.forward(self.handle, x, ids, weights, out, self.threads)
        return out

    def release_caller(self) -> None:
        """The calling thread's CPU affinity as it was when this layer was made: called outside the timed region
        after exllamav3's runs, so a kernel timed next in this process does not run with its caller pinned to one
        core, and exllamav3's own runs are not charged for the unpinning."""
        os.sched_setaffinity(0, self.affinity)


def exllamav3_from(path: Path | str | None):
    """(module, "") loaded from `path` (or $VLLM_EXPERT_OFFLOAD_EXL3_CPU_SCRATCH_EXT), or (None, why not)."""
    path = path or os.environ.get(ENV)
    if not path:
        return None, f"no exllamav3 build given (--exllamav3-ext or ${ENV})"
    if not Path(path).is_file():
        return None, f"exllamav3 build {path} does not exist"
    return load_exllamav3(Path(path)), ""
