"""Build a trimmed exllamav3_ext for the GPU check: exllamav3 1.6.5's own CUDA sources, compiled on a machine without
a GPU, holding only what the plugin's exllamav3 backend calls (kernels/exllamav3_backend.py SIGNATURES), for the
rates and codebooks asked for, against torch 2.11.0+cu130's headers and libraries.

    scripts/build-exllamav3-ext.sh [--arch 90] [--moe-k 3] [--gemm-k 4] [--codebook mul1] [--jobs 2]

Nothing of exllamav3 is kept in the repository: its wheel (and torch's, and the three CUDA header wheels torch's
headers include) are fetched with `pip download` into the ignored `.cache/exllamav3-build/` and unpacked there.
What is compiled of it, as it ships: the host code of exl3_gemm, exl3_moe, exl3_moe_coop and their dependencies
(kernel map, autotuner, device context, GEMV front end); one source is trimmed in its copy (exl3_gemv.cu's kernel
selector keeps only the selected rates). What is generated here, in place of exllamav3's per-(K, codebook) units:
one small unit per kernel instance of the selected rates (so they compile in parallel), tables that hold null for
every other instance, stubs for three paths the backend never reaches (CUDA-graph recording, the opt-in int8 GEMV,
half-integer GEMV), and the registration of the five functions as torch ops (`torch.ops.exllamav3_trimmed.*`).

Why torch ops instead of exllamav3's pybind11 module: the GPU machine runs Python 3.12 and this machine 3.11 with no
3.12 headers to be had; a TORCH_LIBRARY registration needs no Python headers or libpython, so one build serves any
Python that runs torch 2.11.0. The op schemas mark the tensors each kernel writes, so torch.compile keeps them. Every
op refuses a rate or codebook this build did not compile, by name, before launching anything.

Output (ignored, carried to the GPU machine): `.gpucheck/exllamav3_ext/` = `_C.so`, `__init__.py` (loads it and
exposes the functions under exllamav3_ext's names), `manifest.json` (versions, rates, arches, build time, checks);
and `.gpucheck/bin/ninja`, this environment's ninja, for the GPU check's build of the CPU tier's extension.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from vllm_expert_offload.kernels.exllamav3_backend import (  # noqa: E402
    BOOL,
    FLOAT,
    INT,
    OPTIONAL_TENSOR,
    SIGNATURES,
    TENSOR,
    VERSION,
)

TORCH_VERSION = "2.11.0"
# The CUDA header wheels torch 2.11.0's `cuda-toolkit[...]==13.0.2` requirement pins: ATen's CUDAContext.h includes
# cublas_v2.h, cublasLt.h, cusparse.h and cusolverDn.h, which the nvcc install here lacks. Headers only are used.
CUDA_HEADER_WHEELS = ("nvidia-cublas==13.1.0.3", "nvidia-cusparse==12.6.3.3", "nvidia-cusolver==12.0.4.66")
PLATFORM = ["--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
            "--platform", "manylinux_2_27_x86_64", "--platform", "manylinux_2_17_x86_64",
            "--platform", "manylinux2014_x86_64"]
NAMESPACE = "exllamav3_trimmed"
CODEBOOKS = {"3inst": 0, "mcg": 1, "mul1": 2}
INTEGER_K, HALF_K = tuple(range(1, 9)), (1.5, 2.5, 3.5)
GEMM_SHAPES = 7  # EXL3_GEMM_NUM_SHAPES of the CUDA shape table (quant/exl3_kernel_map.cuh)
LIMIT_BYTES = 64 * 2**20  # what may travel to the GPU machine beside the working tree

# Tensors each kernel writes (read off exllamav3 1.6.5's sources): marked `(x!)` in the op schemas so that a
# compiler never drops or reorders a call whose only effect is its writes.
WRITES = {
    "exl3_moe_coop": {"had_g", "had_u", "gu_g", "gu_u", "act_out", "d_out", "ctr", "out", "sh_out"},
    "exl3_moe": {"output_state", "temp_state_g", "temp_state_u", "temp_intermediate_g", "temp_intermediate_u",
                 "output_scratch"},
    "exl3_moe_gather": {"output_state"},
    "exl3_gemm": {"C", "A_had"},
}
RETURNS = {"exl3_moe_max_concurrency": "int"}  # the others return nothing we use (exl3_gemm's shape index dropped)
# Each op's refusal of rates this build lacks, before its launch (C++, in the op wrapper; arguments by name).
RATE_CHECKS = {
    "exl3_moe_coop": "trim_require(\"exl3_moe_coop\", coop_rates, Kg, mcg, mul1);\n"
                     "    trim_require(\"exl3_moe_coop\", coop_rates, Kd, mcg, mul1);",
    "exl3_moe": "trim_require(\"exl3_moe\", (K_gate == K_up && K_up == K_down) ? moe_rates : moe_mixed_rates, "
                "K_gate == K_up && K_up == K_down ? K_gate : 0.0, gate_mcg, gate_mul1);",
    "exl3_gemm": "trim_require(\"exl3_gemm\", gemm_rates, B.size(2) / 16.0, mcg, mul1);",
}


@dataclass(frozen=True)
class Rates:
    """What to compile: bits per weight for the MoE kernels and for exl3_gemm, one codebook set for both."""

    moe: tuple[float, ...]
    gemm: tuple[float, ...]
    codebooks: tuple[str, ...]

    def check(self) -> None:
        for k in (*self.moe, *self.gemm):
            if k not in INTEGER_K and k not in HALF_K:
                raise SystemExit(f"--moe-k/--gemm-k: {k} is not an EXL3 rate (1..8, 1.5, 2.5, 3.5)")
        unknown = set(self.codebooks) - set(CODEBOOKS)
        if unknown:
            raise SystemExit(f"--codebook: {sorted(unknown)} unknown; expected some of {sorted(CODEBOOKS)}")
        if any(k in HALF_K for k in (*self.moe, *self.gemm)) and self.codebooks != ("mul1",):
            raise SystemExit("half-integer rates exist for the mul1 codebook only (exllamav3 refuses the others)")


def moe_codebooks(rates: Rates) -> list[int]:
    """exl3_moe and exl3_moe_coop have no 3INST kernels; exl3_moe refuses it before its launch."""
    return [CODEBOOKS[c] for c in rates.codebooks if c != "3inst"]


# ---------------------------------------------------------------------------------------------------------- fetch

def _pip_download(requirement: str, dest: Path, binary: bool) -> Path:
    name = re.split(r"[=<>]", requirement)[0].replace("-", "_")
    found = sorted(dest.glob(f"{name}-*.whl"))
    if found:
        return found[0]
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), requirement]
    if binary:
        command[4:4] = ["--only-binary=:all:", *PLATFORM]
    subprocess.run(command, check=True)
    found = sorted(dest.glob(f"{name}-*.whl"))
    if not found:
        raise SystemExit(f"pip download {requirement} left no wheel in {dest}")
    return found[0]


def _unpack(wheel: Path, dest: Path, prefixes: tuple[str, ...]) -> None:
    stamp = dest / f".unpacked-{wheel.name}"
    if stamp.exists():
        return
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.namelist():
            if member.startswith(prefixes):
                archive.extract(member, dest)
    stamp.touch()


def fetch(cache: Path) -> dict[str, Path]:
    """exllamav3's sources, torch's headers and libraries, the CUDA headers; downloaded once into `cache`."""
    downloads, unpacked = cache / "dl", cache / "unpacked"
    downloads.mkdir(parents=True, exist_ok=True)
    exl = _pip_download(f"exllamav3=={VERSION}", downloads, binary=False)
    _unpack(exl, unpacked, ("exllamav3/exllamav3_ext/",))
    torch_wheel = _pip_download(f"torch=={TORCH_VERSION}", downloads, binary=True)
    _unpack(torch_wheel, unpacked, ("torch/include/", "torch/version.py", *(f"torch/lib/lib{name}.so" for name in LINK_LIBS)))
    for requirement in CUDA_HEADER_WHEELS:
        _unpack(_pip_download(requirement, downloads, binary=True), unpacked, ("nvidia/cu13/include/",))
    version = (unpacked / "torch" / "version.py").read_text()
    if f"__version__ = '{TORCH_VERSION}+cu130'" not in version:
        raise SystemExit(f"the torch wheel fetched is not {TORCH_VERSION}+cu130: {version}")
    return {"ext": unpacked / "exllamav3" / "exllamav3_ext", "torch": unpacked / "torch",
            "cuda_headers": unpacked / "nvidia" / "cu13" / "include"}


# ------------------------------------------------------------------------------------------------------- generate

def _k_suffix(k: float) -> str:
    """exllamav3's instance names: k3 for 3 bits per weight, h2 for 2.5."""
    return f"h{int(k)}" if k in HALF_K else f"k{int(k)}"


def trim_gemv_selector(text: str, gemm_rates: Rates) -> str:
    """exl3_gemv.cu with its kernel selector cut to fp32-output instances of the selected integer rates (the
    backend's exl3_gemm output is fp32); the original instantiates 88 kernels in that one unit."""
    pattern = re.compile(r"    SEL_GRID\(4, 0, false\).*?SEL_GRID\(3, 2, true\)\n", re.S)
    listed = pattern.findall(text)
    if len(listed) != 1:
        raise SystemExit("exl3_gemv.cu: the SEL_GRID list to trim is not where 1.6.5 has it; the trim needs updating")
    originals = set(re.findall(r"SEL_GRID\((\d), (\d), (true|false)\)", listed[0]))
    keep = []
    for k in gemm_rates.gemm:
        for codebook in gemm_rates.codebooks:
            for smem in ("false", "true"):
                if (str(k), str(CODEBOOKS[codebook]), smem) in originals:
                    keep += [f"SEL({k}, {CODEBOOKS[codebook]}, true, {mm}, {cfg}, {smem})"
                             for mm in (0, 1) for cfg in (0, 1)]
    return pattern.sub("    " + " ".join(keep) + "\n" if keep else "", text)


def _unit(includes: str, body: str) -> str:
    return f"// Generated by scripts/build-exllamav3-ext.py; not part of exllamav3.\n{includes}\n{body}\n"


GEMM_INCLUDES = """#include <cuda_fp16.h>
#include <cublas_v2.h>
#include <cooperative_groups.h>
namespace cg = cooperative_groups;
#include "../../util.h"
#include "../../util.cuh"
#include "../../ptx.cuh"
#include "../exl3_gemm_kernel.cuh\""""


def generated_units(rates: Rates) -> dict[str, str]:
    """File name (under quant/comp_units/) -> source, for the selected instances and the tables around them."""
    units: dict[str, str] = {}
    # exl3_gemm: one unit per (rate, codebook, shape), fp32 output only; every other table entry null.
    tables = []
    for k in (*INTEGER_K, *HALF_K):
        for codebook, cb in ([("mul1", 2)] if k in HALF_K else CODEBOOKS.items()):
            for fp in ("fp32", "fp16"):
                for kind in ("gemm", "mgemm"):
                    name = (f"tfp_exl3_{kind}_kernel_{fp}_h{int(k)}" if k in HALF_K
                            else f"tfp_exl3_{kind}_kernel_{fp}_b{k}_cb{cb}")
                    wanted = kind == "gemm" and fp == "fp32" and k in rates.gemm and codebook in rates.codebooks
                    if not wanted:
                        tables.append(f"fp_exl3_{kind}_kernel {name}[EXL3_GEMM_NUM_SHAPES + 1] = {{}};")
                        continue
                    getters = []
                    for shape in range(1, GEMM_SHAPES + 1):
                        getter = f"trim_gemm_{_k_suffix(k)}_cb{cb}_s{shape}"
                        half = "true" if k in HALF_K else "false"
                        units[f"trim_{getter[5:]}.cu"] = _unit(GEMM_INCLUDES, (
                            f"fp_exl3_gemm_kernel {getter}() {{ return exl3_gemm_kernel<{int(k)}, {half}, true, {cb}, "
                            f"EXL3_GEMM_SHAPE_{shape}>; }}"))
                        getters.append(getter)
                    tables.insert(0, "".join(f"fp_exl3_gemm_kernel {g}();\n" for g in getters))
                    tables.append(f"fp_exl3_gemm_kernel {name}[] = {{ nullptr, {', '.join(g + '()' for g in getters)} }};")
    units["trim_gemm_tables.cu"] = _unit('#include <cuda_fp16.h>\n#include "../exl3_kernel_map.cuh"', "\n".join(tables))
    # exl3_moe: the getters exl3_moe.cu's instance tables call at load; null for every instance not built.
    moe = ['#include "exl3_moe_instances.cuh"']
    for k in (0, *INTEGER_K):
        for cb in (1, 2):
            for n in (128, 256):
                wanted = k in rates.moe and cb in moe_codebooks(rates)
                moe.append(_moe_getter(f"exl3_moe_kernel_k{k}_n{n}_cb{cb}", f"{k}, {n}, {cb}", wanted, units))
        for m in (32, 64):
            moe.append(_moe_getter(f"exl3_moe_kernel_k{k}_n128_cb2_m{m}", "", False, units))
    for k in (1, 2, 3):
        for n in (128, 256):
            wanted = k + 0.5 in rates.moe and 2 in moe_codebooks(rates)
            moe.append(_moe_getter(f"exl3_moe_kernel_h{k}_n{n}_cb2", f"{k}, {n}, 2, MOE_TILESIZE_M, true", wanted,
                                   units))
        for m in (32, 64):
            moe.append(_moe_getter(f"exl3_moe_kernel_h{k}_n128_cb2_m{m}", "", False, units))
    units["trim_moe_getters.cu"] = _unit("", "\n".join(moe))
    # exl3_moe_coop: per rate, the gate/up (A) and down (B) kernels of the selected codebooks.
    coop = ['#include "exl3_moe_coop_instances.cuh"']
    for k in (*INTEGER_K, *HALF_K):
        suffix = _k_suffix(k)
        half = k in HALF_K
        cbs = [cb for cb in moe_codebooks(rates) if not half or cb == 2] if k in rates.moe else []
        if cbs:
            units[f"trim_coop_{suffix}.cu"] = _unit(
                '#include "exl3_moe_coop_instances.cuh"\n#include "../exl3_moe_coop_kernel.cuh"',
                _coop_getters(int(k), half, cbs))
        else:
            coop.append(_coop_getters(int(k), half, []))
    units["trim_coop_null.cu"] = _unit("", "\n".join(coop))
    return units


def _moe_getter(name: str, template_args: str, wanted: bool, units: dict[str, str]) -> str:
    if not wanted:
        return f"fp_exl3_moe_kernel {name}() {{ return nullptr; }}"
    units[f"trim_{name[len('exl3_'):]}.cu"] = _unit('#include "exl3_moe_inst_common.cuh"',
                                         f"fp_exl3_moe_kernel {name}() {{ return exl3_moe_kernel<{template_args}>; }}")
    return f"// {name}: trim_{name[len('exl3_'):]}.cu"


def _coop_getters(k: int, half: bool, cbs: list[int]) -> str:
    """exllamav3's EXL3_MOE_COOP_INST_DEF(_H) bodies, restricted to `cbs` ({nullptr, 0} for any other)."""
    suffix, extra = (f"h{k}", ", true") if half else (f"k{k}", "")
    args_a, args_b = ("int Hi, bool wide", "bool wide") if half else ("int cb, int Hi, bool wide", "int cb, bool wide")
    cb_of = "2" if half else "cb"
    lines = []
    for part, args, smem in (("a", args_a, f"smem_a_bytes<{k}{extra}>(Hi)"), ("b", args_b, f"smem_b_bytes<{k}{extra}>()")):
        lines.append(f"MoeCoopKernel exl3_moe_coop_kernel_{part}_{suffix}({args})\n{{")
        if cbs:
            lines.append("    using namespace exl3_moe_coop_ns;")
            for cb in cbs:
                for wide in ("true", "false"):
                    lines.append(f"    if ({cb_of} == {cb} && wide == {wide}) return {{ (void*) exl3_moe_coop_{part}_kernel"
                                 f"<{k}, {cb}, {wide}{extra}>, {smem} }};")
        lines.append("    return { nullptr, 0 };\n}")
    return "\n".join(lines)


STUBS = """// Generated by scripts/build-exllamav3-ext.py: paths of exllamav3 1.6.5 the plugin's backend never reaches.
#include <ATen/Tensor.h>
#include <c10/util/Exception.h>
#include "../graph.cuh"
#include "exl3_gemv.cuh"
#include "exl3_gemv_int8.cuh"

// exllamav3's own CUDA-graph recording (exl3_gemm_gr with a Graph); the backend calls exl3_gemm, which passes none.
void Graph::record_param(void*, int, int, int)
{
    TORCH_CHECK(false, "trimmed exllamav3_ext: exllamav3's own graph recording is not built");
}

// The int8-activation GEMV, off unless EXL3_INT8_GEMV asks for it; not built, so always off.
bool exl3_gemv_int8_enabled() { return false; }
int exl3_gemv_int8_max_k(int) { return 0; }
bool exl3_gemv_int8(const at::Tensor&, const at::Tensor&, at::Tensor&, const c10::optional<at::Tensor>&,
                    const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, cudaStream_t, Graph*)
{
    return false;
}

// Half-integer GEMV instances: not built; exl3_gemm then runs its regular kernel.
void* exl3_gemv_select_kernel_half(int, bool, int, int, bool) { return nullptr; }
"""

CPP_TYPES = {TENSOR: "const at::Tensor&", OPTIONAL_TENSOR: "const std::optional<at::Tensor>&", INT: "int64_t",
             FLOAT: "double", BOOL: "bool"}
SCHEMA_TYPES = {TENSOR: "Tensor", OPTIONAL_TENSOR: "Tensor?", INT: "int", FLOAT: "float", BOOL: "bool"}
CASTS = {INT: "(int) ", FLOAT: "(float) "}


def op_schema(name: str) -> str:
    """The torch op schema of `name`: SIGNATURES' arguments in order, written tensors marked with an alias set."""
    arguments, letters = [], iter("abcdefghijklmnopqrstuvwxyz")
    for argument, kind in SIGNATURES[name]:
        written = argument in WRITES.get(name, ())
        if written and kind not in (TENSOR, OPTIONAL_TENSOR):
            raise ValueError(f"{name}.{argument} is listed as written but is a {kind}")
        typ = SCHEMA_TYPES[kind]
        if written:
            typ = f"Tensor({next(letters)}!)" + ("?" if kind == OPTIONAL_TENSOR else "")
        arguments.append(f"{typ} {argument}")
    return f"{name}({', '.join(arguments)}) -> {RETURNS.get(name, '()')}"


def _wrapper(name: str) -> str:
    params, call = [], []
    for argument, kind in SIGNATURES[name]:
        written = argument in WRITES.get(name, ()) and kind == TENSOR
        params.append(f"{'at::Tensor&' if written else CPP_TYPES[kind]} {argument}")
        call.append(f"{CASTS.get(kind, '')}{argument}")
    returns = RETURNS.get(name) == "int"
    body = RATE_CHECKS.get(name, "")
    statement = f"{'return ' if returns else ''}{name}({', '.join(call)});"
    return (f"static {'int64_t' if returns else 'void'} trim_{name}({', '.join(params)})\n{{\n"
            f"    {body}\n    {statement}\n}}\n")


def registration(rates: Rates) -> str:
    """The op registrations and their wrappers (rate refusals, int/float widening to the op calling convention)."""
    def table(values: list[str]) -> str:
        return "{" + ", ".join(values) + "}"

    def rate_set(ks: tuple[float, ...], cbs: list[int]) -> str:
        return table([f"{{{int(2 * k)}, {cb}}}" for k in ks for cb in cbs if k in INTEGER_K or cb == 2])

    gemm_cbs = [CODEBOOKS[c] for c in rates.codebooks]
    moe_cbs = moe_codebooks(rates)
    built = ", ".join(f"{k:g}" for k in rates.moe)
    lines = [
        "// Generated by scripts/build-exllamav3-ext.py: exllamav3 1.6.5's functions as torch ops.",
        "#include <set>", "#include <utility>", "#include <ATen/ATen.h>", "#include <torch/library.h>",
        '#include "quant/exl3_gemm.cuh"', '#include "quant/exl3_moe.cuh"', '#include "quant/exl3_moe_coop.cuh"', "",
        "using Rates = std::set<std::pair<int, int>>;  // (2K, codebook id)",
        f"static const Rates moe_rates = {rate_set(rates.moe, moe_cbs)};",
        f"static const Rates coop_rates = {rate_set(rates.moe, moe_cbs)};",
        "static const Rates moe_mixed_rates = {};  // the runtime-K (K = 0) instances are not built",
        f"static const Rates gemm_rates = {rate_set(rates.gemm, gemm_cbs)};", "",
        "static void trim_require(const char* op, const Rates& built, double k, bool mcg, bool mul1)",
        "{",
        "    const int cb = mcg ? 1 : (mul1 ? 2 : 0);",
        "    TORCH_CHECK(built.count({(int) (2 * k + 0.5), cb}), \"trimmed exllamav3_ext: \", op, \" at K=\", k,",
        "                (k == 0.0 ? \" (mixed K across gate/up/down)\" : \"\"), \" codebook \", cb,",
        f"                \" is not built (MoE K: {built}; exl3_gemm K: {', '.join(f'{k:g}' for k in rates.gemm)};"
        f" codebooks: {', '.join(rates.codebooks)}); rebuild with scripts/build-exllamav3-ext.sh\");",
        "}", "",
    ]
    lines += [_wrapper(name) for name in SIGNATURES]
    lines.append(f"TORCH_LIBRARY({NAMESPACE}, m)\n{{")
    for name in SIGNATURES:
        if name in RETURNS:  # no tensor to dispatch on: one kernel for every backend
            lines.append(f'    m.def("{op_schema(name)}", &trim_{name});')
        else:
            lines.append(f'    m.def("{op_schema(name)}");')
    lines.append(f"}}\n\nTORCH_LIBRARY_IMPL({NAMESPACE}, CUDA, m)\n{{")
    lines += [f'    m.impl("{name}", &trim_{name});' for name in SIGNATURES if name not in RETURNS]
    lines.append("}")
    return "\n".join(lines) + "\n"


SHIM = '''"""A trimmed build of exllamav3 {version}'s CUDA extension (scripts/build-exllamav3-ext.py in vllm-expert-offload):
the functions the plugin's exllamav3 backend calls, as torch ops, under exllamav3_ext's names. Rates built:
MoE K {moe}, exl3_gemm K {gemm}, codebooks {codebooks}; any other is refused by name."""

import json
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
MANIFEST = json.loads((HERE / "manifest.json").read_text())
try:
    torch.ops.load_library(str(HERE / "_C.so"))
except (OSError, RuntimeError) as exc:  # an import failure, so the backend reports it as the reason it is unavailable
    raise ImportError(f"the trimmed exllamav3_ext at {{HERE}} does not load under torch {{torch.__version__}}: {{exc}}") from exc

_OPS = getattr(torch.ops, "{namespace}")
{exports}

for _name in {written}:
    torch.library.register_fake(f"{namespace}::{{_name}}")(lambda *args, **kwargs: None)
'''


def shim(rates: Rates) -> str:
    exports = "\n".join(f"{name} = _OPS.{name}" for name in SIGNATURES)
    return SHIM.format(version=VERSION, moe=", ".join(f"{k:g}" for k in rates.moe),
                       gemm=", ".join(f"{k:g}" for k in rates.gemm), codebooks=", ".join(rates.codebooks),
                       namespace=NAMESPACE, exports=exports, written=sorted(WRITES))


# -------------------------------------------------------------------------------------------------------- compile

HOST_SOURCES = ("quant/exl3_gemm.cu", "quant/exl3_kernel_map.cu", "quant/coop_autotune.cu", "quant/exl3_devctx.cu",
                "quant/exl3_gemv.cu", "quant/exl3_moe.cu", "quant/exl3_moe_coop.cu")
PYBIND_STUB = "// Generated: exllamav3's graph.cuh includes pybind11; nothing this build compiles uses it.\nnamespace pybind11 {}\n"


def prepare_sources(paths: dict[str, Path], build: Path, rates: Rates) -> list[Path]:
    """A fresh copy of exllamav3_ext with the trims and generated units; returns the translation units."""
    src = build / "src"
    if src.exists():
        shutil.rmtree(src)
    shutil.copytree(paths["ext"], src)
    gemv = src / "quant" / "exl3_gemv.cu"
    gemv.write_text(trim_gemv_selector(gemv.read_text(), rates))
    units = [src / s for s in HOST_SOURCES]
    for name, text in generated_units(rates).items():
        path = src / "quant" / "comp_units" / name
        path.write_text(text)
        units.append(path)
    (src / "quant" / "trim_stubs.cu").write_text(STUBS)
    (src / "trim_register.cpp").write_text(registration(rates))
    stub_include = build / "stub_include" / "pybind11"
    stub_include.mkdir(parents=True, exist_ok=True)
    (stub_include / "pybind11.h").write_text(PYBIND_STUB)
    return units + [src / "quant" / "trim_stubs.cu", src / "trim_register.cpp"]


def nvcc() -> str:
    found = shutil.which("nvcc")
    if found is None:
        raise SystemExit("nvcc not found on PATH (CUDA 13.0's nvcc is needed)")
    return found


def compile_flags(paths: dict[str, Path], build: Path, arches: list[str]) -> list[str]:
    """exllamav3's own nvcc flags (util/cuda_flags.py) plus torch 2.11's extension defaults (COMMON_NVCC_FLAGS,
    C++17, -fPIC, the C++11 ABI torch was built with), for the requested SASS targets and no PTX."""
    torch_include = paths["torch"] / "include"
    flags = ["-O3", "--use_fast_math", "-Xcudafe", "--diag_suppress=177", "-Xcudafe", "--diag_suppress=20012",
             "--compress-mode=size", "-std=c++17", "-Xcompiler", "-fPIC", "-D_GLIBCXX_USE_CXX11_ABI=1",
             "-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__", "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
             "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr", "-DTORCH_EXTENSION_NAME=exllamav3_ext",
             f"-I{build / 'stub_include'}", f"-I{torch_include}", f"-I{torch_include / 'torch/csrc/api/include'}",
             f"-I{paths['cuda_headers']}", f"-I{build / 'src'}"]
    for arch in arches:
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    return flags


def _compile_one(unit: Path, flags: list[str], objects: Path) -> tuple[Path, float, bool]:
    digest = hashlib.sha256((unit.read_text() + "\0".join(flags)).encode()).hexdigest()[:16]
    obj = objects / f"{unit.stem}-{digest}.o"
    if obj.exists():
        return obj, 0.0, True
    start = time.monotonic()
    command = ["nice", "-n", "15", nvcc(), "-c", str(unit), "-o", str(obj) + ".tmp", *flags]
    if unit.suffix == ".cpp":
        command += ["-x", "cu"]  # one compiler driver for every unit keeps the flags identical
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"nvcc failed on {unit}:\n{result.stderr[-6000:]}")
    os.replace(str(obj) + ".tmp", obj)
    return obj, time.monotonic() - start, False


def compile_all(units: list[Path], flags: list[str], build: Path, jobs: int) -> tuple[list[Path], dict[str, float]]:
    objects = build / "obj"
    objects.mkdir(exist_ok=True)
    seconds: dict[str, float] = {}
    results = []
    # Host units first: a source or flag problem shows in minutes, before the long kernel instances.
    order = sorted(units, key=lambda u: ("trim_" in u.name, u.name))
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for obj, spent, cached in pool.map(lambda u: _compile_one(u, flags, objects), order):
            results.append(obj)
            seconds[obj.name.rsplit("-", 1)[0]] = spent
            print(f"  {'cached ' if cached else ''}{obj.name.rsplit('-', 1)[0]}: {spent:.0f} s", flush=True)
    return results, seconds


LINK_LIBS = ("c10", "c10_cuda", "torch_cpu", "torch_cuda")


def cudart_dir() -> Path:
    lib = Path(nvcc()).resolve().parents[1]
    for candidate in (lib / "lib64", lib / "lib", Path("/usr/local/cuda/lib64")):
        if (candidate / "libcudart.so.13").exists():
            return candidate
    raise SystemExit("libcudart.so.13 not found next to nvcc")


def link(objects: list[Path], paths: dict[str, Path], out: Path) -> None:
    """One shared object; every symbol must resolve against torch 2.11's libraries, cudart 13 and the C/C++
    runtimes (--no-undefined), so a missing dependency fails here and not on the GPU machine."""
    lib = paths["torch"] / "lib"
    command = ["g++", "-shared", "-o", str(out), *map(str, objects), f"-L{lib}", *(f"-l{name}" for name in LINK_LIBS),
               f"-L{cudart_dir()}", "-lcudart", "-Wl,--no-undefined", "-Wl,--as-needed", "-Wl,-O1", "-s"]
    subprocess.run(command, check=True)


# --------------------------------------------------------------------------------------------------------- verify

ALLOWED_NEEDED = {f"lib{name}.so" for name in LINK_LIBS} | {"libcudart.so.13", "libstdc++.so.6", "libm.so.6",
                                                            "libgcc_s.so.1", "libc.so.6", "ld-linux-x86-64.so.2"}
# Symbol versions the GPU machine's C runtimes must provide. Its image runs Python 3.12.3, Ubuntu 24.04's (glibc 2.39,
# GCC 14's libstdc++); the limits stay at Ubuntu 22.04's, so a build host newer than this Debian 12 fails here.
MAX_GLIBC, MAX_GLIBCXX = (2, 35), (3, 4, 30)
REGISTRATION_CHECK = r"""
#include <dlfcn.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <iostream>
// Loads the library into torch 2.11.0's own dispatcher (its libc10/libtorch_cpu, no GPU needed) and prints each op.
int main(int argc, char** argv)
{
    if (!dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL)) { std::cerr << "dlopen: " << dlerror() << "\n"; return 1; }
    for (int i = 3; i < argc; ++i)
    {
        auto op = c10::Dispatcher::singleton().findSchema({std::string(argv[2]) + "::" + argv[i], ""});
        if (!op) { std::cerr << "no op " << argv[i] << "\n"; return 1; }
        std::cout << argv[i] << " cuda=" << op->hasKernelForDispatchKey(c10::DispatchKey::CUDA) << " " << op->schema()
                  << "\n";
    }
    return 0;
}
"""


def _versions(text: str, prefix: str) -> list[tuple[int, ...]]:
    return [tuple(int(p) for p in v.split(".")) for v in re.findall(rf"\b{prefix}_([0-9.]+[0-9])\b", text)]


def cuobjdump() -> str | None:
    """Triton ships cuobjdump with its NVIDIA backend; the nvcc install here has none."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    candidate = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(candidate) if candidate.exists() else None


def verify(so: Path, arches: list[str], torch_dir: Path, build: Path) -> dict:
    """The facts the GPU machine depends on, checked here: size, what it links, symbol versions, SASS targets,
    the registration and the absence of anything Python."""
    readelf = subprocess.run(["readelf", "-d", "-V", str(so)], capture_output=True, text=True, check=True).stdout
    needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", readelf))
    undefined = subprocess.run(["nm", "-D", "--undefined-only", str(so)], capture_output=True, text=True,
                               check=True).stdout
    report = {"bytes": so.stat().st_size, "needed": sorted(needed),
              "max_glibc": ".".join(map(str, max(_versions(readelf, "GLIBC"), default=(0,)))),
              "max_glibcxx": ".".join(map(str, max(_versions(readelf, "GLIBCXX"), default=(0,))))}
    problems = []
    if report["bytes"] > LIMIT_BYTES:
        problems.append(f"{so} is {report['bytes']} bytes, over the {LIMIT_BYTES} that may travel")
    if needed - ALLOWED_NEEDED:
        problems.append(f"links libraries torch does not ship: {sorted(needed - ALLOWED_NEEDED)}")
    if re.search(r"\b_?Py\w+", undefined):
        problems.append("references Python symbols; the build must not depend on a Python version")
    if max(_versions(readelf, "GLIBC"), default=(0,)) > MAX_GLIBC:
        problems.append(f"needs glibc {report['max_glibc']} (> {'.'.join(map(str, MAX_GLIBC))})")
    if max(_versions(readelf, "GLIBCXX"), default=(0,)) > MAX_GLIBCXX:
        problems.append(f"needs GLIBCXX {report['max_glibcxx']} (> {'.'.join(map(str, MAX_GLIBCXX))})")
    dump = cuobjdump()
    if dump is None:
        problems.append("no cuobjdump to list the embedded SASS (install triton, which ships one)")
    else:
        listing = subprocess.run([dump, "--list-elf", str(so)], capture_output=True, text=True, check=True).stdout
        found = sorted(set(re.findall(r"\.sm_(\d+)\.", listing)))
        report["sass_arches"], report["cubins"] = found, listing.count(".cubin")
        if found != sorted(arches):
            problems.append(f"embedded SASS for sm_{found}, asked for sm_{sorted(arches)}")
        ptx = subprocess.run([dump, "--list-ptx", str(so)], capture_output=True, text=True).stdout
        if ".ptx" in ptx:
            problems.append("embeds PTX (only SASS was asked for)")
    problems += registration_problems(so, torch_dir, build)
    report["problems"] = problems
    return report


def registration_problems(so: Path, torch_dir: Path, build: Path) -> list[str]:
    """Load the library into torch 2.11.0's dispatcher here (a small C++ program against its libraries): every op
    registered with the schema op_schema() gives, the tensor ops with a CUDA kernel. Catches an ABI or schema
    mismatch, which would otherwise first show when the GPU machine imports it."""
    source, program = build / "registration_check.cpp", build / "registration_check"
    source.write_text(REGISTRATION_CHECK)
    subprocess.run(["g++", "-std=c++17", "-D_GLIBCXX_USE_CXX11_ABI=1", f"-I{torch_dir / 'include'}", str(source), "-o",
                    str(program), f"-L{torch_dir / 'lib'}", "-lc10", "-ltorch_cpu", "-ldl",
                    "-Wl,--allow-shlib-undefined"], check=True)
    env = {**os.environ, "LD_LIBRARY_PATH": f"{torch_dir / 'lib'}:{cudart_dir()}"}
    result = subprocess.run([str(program), str(so), NAMESPACE, *SIGNATURES], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        return [f"does not load into torch {TORCH_VERSION}'s dispatcher: {result.stderr.strip()}"]
    problems = []
    for line in result.stdout.splitlines():
        name, cuda, schema = line.split(" ", 2)
        if schema != f"{NAMESPACE}::{op_schema(name)}":
            problems.append(f"{name} registered as {schema}")
        if cuda != f"cuda={0 if name in RETURNS else 1}":
            problems.append(f"{name}: {cuda}, expected a CUDA kernel for every op with tensors")
    return problems


# ------------------------------------------------------------------------------------------------------------ main

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=REPO / ".cache" / "exllamav3-build")
    parser.add_argument("--out", type=Path, default=REPO / ".gpucheck" / "exllamav3_ext")
    parser.add_argument("--arch", default="90", help="comma-separated SASS targets, e.g. 90 or 90,120")
    parser.add_argument("--moe-k", default="3", help="bits per weight of the MoE kernels (the GPU tests use 3)")
    parser.add_argument("--gemm-k", default="4", help="bits per weight of exl3_gemm (the GPU tests use 4)")
    parser.add_argument("--codebook", default="mul1", help="comma-separated codebooks (the GPU tests use mul1)")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    rates = Rates(tuple(float(k) if "." in k else int(k) for k in args.moe_k.split(",")),
                  tuple(float(k) if "." in k else int(k) for k in args.gemm_k.split(",")),
                  tuple(args.codebook.split(",")))
    rates.check()
    arches = args.arch.split(",")
    started = time.monotonic()
    paths = fetch(args.cache)
    build = args.cache / "build"
    units = prepare_sources(paths, build, rates)
    flags = compile_flags(paths, build, arches)
    print(f"compiling {len(units)} units for sm_{','.join(arches)} with {args.jobs} jobs (nice 15)", flush=True)
    objects, seconds = compile_all(units, flags, build, args.jobs)
    args.out.mkdir(parents=True, exist_ok=True)
    so = args.out / "_C.so"
    link(objects, paths, so)
    report = verify(so, arches, paths["torch"], build)
    manifest = {"exllamav3": VERSION, "torch": f"{TORCH_VERSION}+cu130", "namespace": NAMESPACE, "arches": arches,
                "moe_k": list(rates.moe), "gemm_k": list(rates.gemm), "codebooks": list(rates.codebooks),
                "functions": sorted(SIGNATURES), "build_wall_s": round(time.monotonic() - started),
                "compile_s": {k: round(v) for k, v in sorted(seconds.items())}, "jobs": args.jobs, **report}
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (args.out / "__init__.py").write_text(shim(rates))
    print(json.dumps({k: v for k, v in manifest.items() if k != "compile_s"}, indent=1))
    if report["problems"]:
        print("build-exllamav3-ext: FAILED checks:\n  " + "\n  ".join(report["problems"]), file=sys.stderr)
        return 1
    print(f"build-exllamav3-ext: {so} ({report['bytes'] / 2**20:.1f} MiB) in {manifest['build_wall_s']} s")
    return carry_ninja(args.out.parent / "bin")


def carry_ninja(bin_dir: Path) -> int:
    """Copy this environment's ninja beside the extension: the GPU check builds the CPU tier's extension with torch's
    cpp_extension, which needs ninja, and the lent machine's torch + Triton install has none (its pip cannot reach
    an index); gpu-check.sh puts this directory on PATH only where no ninja is found."""
    ninja = shutil.which("ninja") or shutil.which("ninja", path=str(Path(sys.executable).parent))
    if ninja is None:
        print("build-exllamav3-ext: no ninja here to carry (pip install ninja): the GPU check's CPU tier lane "
              "will be refused on a machine without one", file=sys.stderr)
        return 1
    bin_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(ninja, bin_dir / "ninja")
    print(f"build-exllamav3-ext: carried {ninja} as {bin_dir / 'ninja'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
