"""Our C++ MoE forward (kernels/cpu_moe.py) against exllamav3 1.6.5's CPU MoE, in one process, same inputs.

Why: issue #41's anchor is exllamav3's CPU MoE (exllamav3_ext/cpu/moe_mul1.cpp); a figure measured on another
machine says nothing about ours here. Both run the same layer (MUL1 experts from tools/random_layers.py, the same
trellis/suh/svh bytes), the same threads, the same tokens routed to every expert, so each forward reads every
weight once; reported in billions of weights per second per K (1-8) at 1 and 8 tokens, with the ratio, plus the
largest relative difference of the two outputs (a check that both compute the same MLP: exllamav3 takes fp16
rows, so it agrees to fp16 rounding, not bit for bit).

exllamav3's kernel is not vendored: `--build DIR` downloads the 1.6.5 wheel with pip, writes a small pybind
binding and compiles moe_mul1.cpp into DIR with torch.utils.cpp_extension (about 5 minutes on 2 cores);
`--ext PATH` (or $EXL3_CPU_SCRATCH_EXT) loads an earlier build. Without either, its column is skipped with the
reason. Nothing of it is ever committed.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/bench_cpu_moe_vs_exllamav3.py --ext /tmp/exl3cpu/exl3cpu_scratch.so
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import torch

from vllm_expert_offload.exl3.naming import PROJECTIONS
from vllm_expert_offload.tools.random_layers import median_seconds, random_moe

CPU = torch.device("cpu")
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
        group, planar = module.swizzle_group(float(k)), module.planar_layout(float(k))
        lists = []
        for p in PROJECTIONS:
            lists.append([packed_trellis(s[p].trellis, group, planar) for s in sets])
            lists.append([s[p].suh.contiguous() for s in sets])
            lists.append([s[p].svh.contiguous() for s in sets])
        self.keep = lists
        self.handle = module.make_layer(*lists, [], [], [], 0, 0.0, 1 if group else 0)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape, dtype=torch.float32)
        self.module.forward(self.handle, x, ids, weights, out, self.threads)
        return out


def measure(module, shape: dict, k: int, tokens: int, repeats: int, threads: int) -> dict:
    """Gweights/s of ours (and exllamav3's when `module`) for one K and token count, same inputs."""
    moe = random_moe(**shape, k=k, host_share=1.0, backend="cpu", device=CPU, dtype=torch.float32)
    weights_per_forward = shape["experts"] * 3 * shape["hidden"] * shape["intermediate"]
    gen = torch.Generator().manual_seed(tokens)
    # fp16-representable inputs, so both kernels see the same numbers
    x = torch.randn(tokens, shape["hidden"], generator=gen).half()
    ids = torch.arange(shape["experts"]).repeat(tokens, 1)
    weights = torch.rand(tokens, shape["experts"], generator=gen).half()
    ours = moe.kernel.forward(x.float(), weights.float(), ids, False)
    row = {"k": k, "tokens": tokens,
           "ours": weights_per_forward / median_seconds(
               lambda: moe.kernel.forward(x.float(), weights.float(), ids, False), repeats, CPU) / 1e9}
    if module is not None:
        layer = Exllamav3Layer(module, moe.sets, k, threads)
        theirs = layer.forward(x, weights, ids)
        row["exllamav3"] = weights_per_forward / median_seconds(
            lambda: layer.forward(x, weights, ids), repeats, CPU) / 1e9
        row["ratio"] = row["ours"] / row["exllamav3"]
        row["max_rel_diff"] = float((ours - theirs).abs().max() / theirs.abs().max())
        module.free_layer(layer.handle)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ext", type=Path, default=os.environ.get("EXL3_CPU_SCRATCH_EXT"),
                        help="an earlier --build's exl3cpu_scratch.so")
    parser.add_argument("--build", type=Path, help="download and compile exllamav3's CPU MoE into this directory")
    parser.add_argument("--ks", type=lambda s: [int(k) for k in s.split(",")], default=list(range(1, 9)))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    path = build_exllamav3(args.build) if args.build else args.ext
    module, reason = None, "no --ext/--build given (nor $EXL3_CPU_SCRATCH_EXT)"
    if path is not None:
        if Path(path).is_file():
            module, reason = load_exllamav3(Path(path)), ""
        else:
            reason = f"{path} does not exist"
    if module is None:
        print(f"exllamav3 skipped: {reason}")
    threads = torch.get_num_threads()
    shape = {"hidden": args.hidden, "intermediate": args.intermediate, "experts": args.experts}
    print(f"threads {threads}, hidden {args.hidden}, intermediate {args.intermediate}, experts {args.experts}, MUL1")
    print(f"{'K':>2} {'tok':>3} {'ours':>8} {'exl3':>8} {'ratio':>6} {'rel.diff':>9}  (Gweights/s)")
    rows = []
    for k in args.ks:
        for tokens in (1, 8):
            row = measure(module, shape, k, tokens, args.repeats, threads)
            rows.append(row)
            if module is None:
                print(f"{k:>2} {tokens:>3} {row['ours']:8.3f} {'-':>8} {'-':>6} {'-':>9}")
            else:
                print(f"{k:>2} {tokens:>3} {row['ours']:8.3f} {row['exllamav3']:8.3f} {row['ratio']:6.2f} "
                      f"{row['max_rel_diff']:9.2e}")
    if args.json:
        args.json.write_text(json.dumps({"threads": threads, "shape": shape, "exllamav3_skipped": reason,
                                         "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
