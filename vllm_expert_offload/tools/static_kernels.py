"""`bench-kernels --static`: the Triton backend's kernels compiled ahead of time for sm_90 and sm_120 on a machine
without a GPU (Triton's compiler, the ptxas and nvdisasm Triton ships), and what the result says about them.

Per target and kernel (kernels/static_spec.py says what a kernel module lists), compiled as the backend's launches
specialise it (the arguments it always passes aligned to 16, `StaticKernel.aligned`):
- `registers`, `spills` (spill store + load bytes): `ptxas -v` on the kernel's PTX with the flags Triton passes;
- `shared_bytes`: the shared memory Triton requests at launch (the compiled kernel's metadata);
- `trellis_load_bits`: the narrowest global load of trellis memory, found by address provenance (ptx_analysis.py:
  a table's offsets into other arrays, such as the dense kernel's suh/svh, are not trellis);
- `ptx_per_weight` / `sass_per_weight`: instructions of the decode loop per weight each thread decodes, i.e. the
  loop's instruction count (with the loops nested in it) divided by weights_per_iteration / (num_warps * 32), in
  PTX and in the SASS ptxas made, whose decode loop ptxas's line info finds (the SASS count is what the GPU issues;
  issue #24's 20/38/52 for 3INST/MUL1/mixed are SASS counts).
Compiles go through Triton's on-disk cache, so a second run takes seconds. They need Triton's compiler, which a
process running its interpreter (the CPU tests, the launch census) does not have: `compile_report` runs them in a
child Python without TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from ..kernels.static_spec import LayerShape, StaticKernel
from . import ptx_analysis
from .errors import ToolInputError, ToolRunError
from .json_child import resolve, run_json

TARGETS = {"sm_90": 90, "sm_120": 120}


@dataclass(frozen=True)
class Compiled:
    ptx: str
    cubin: bytes
    shared_bytes: int
    ptxas: str  # path of the ptxas that made the cubin


def _triton_tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def _alignment_attrs(kernel: StaticKernel) -> dict[tuple[int], list]:
    """The attributes Triton's launch gives the `aligned` arguments (ASTSource's `attrs`, keyed by position)."""
    runtime = [name for name in kernel.signature if name not in kernel.constexprs]
    wrong = [name for name in kernel.aligned if name not in runtime]
    if wrong:
        raise ToolInputError(f"{kernel.name}: aligned {wrong} are not runtime arguments of {runtime}")
    return {(kernel.fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in kernel.aligned}


def compile_kernel(kernel: StaticKernel, capability: int) -> Compiled:
    """`triton.compile` of one StaticKernel for `capability` (90, 120), specialised as the backend's launches
    specialise it (`StaticKernel.aligned`): no GPU is touched."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    signature = dict(kernel.signature) | {name: "constexpr" for name in kernel.constexprs}
    source = ASTSource(fn=kernel.fn, signature=signature, constexprs=dict(kernel.constexprs),
                       attrs=_alignment_attrs(kernel))
    options = {"num_warps": kernel.num_warps, "num_stages": kernel.num_stages, **kernel.options}
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
    return Compiled(compiled.asm["ptx"], compiled.asm["cubin"], compiled.metadata.shared, get_ptxas(capability).path)


def _front_end(kernel: StaticKernel, capability: int):
    """(Triton IR as the front end makes it, before any pass: every @triton.jit function the kernel calls is still
    one function per specialisation; the backend; its options; the source's language)."""
    import triton
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", capability, 32)
    signature = dict(kernel.signature) | {name: "constexpr" for name in kernel.constexprs}
    source = ASTSource(fn=kernel.fn, signature=signature, constexprs=dict(kernel.constexprs),
                       attrs=_alignment_attrs(kernel))
    backend = triton.compiler.compiler.make_backend(target)
    options = backend.parse_options({"num_warps": kernel.num_warps, "num_stages": kernel.num_stages, **kernel.options})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = source.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                            context)
    return module, backend, options, source.language


# A function (or call) of the front end's IR, by its name: quoted where it holds a '-' (a mixed table's constexpr key)
# or, under Triton 3.6, the parentheses of its mangled constexprs.
_FUNCTION = r'tt\.func (?:private |public )?@(?:"([^"]+)"|([\w.$-]+))'
_CALL = r'tt\.call @(?:"([^"]+)"|([\w.$-]+))'


def called_functions(kernel: StaticKernel, capability: int) -> list[str]:
    """The specialisations of @triton.jit functions `kernel` calls (Triton's mangled names: module.function__ then
    the argument types and `c<value>` per constexpr), from the front end alone (about a second): which code a
    compile would hold, e.g. which rates' decode a mixed table's kernel compiles."""
    return sorted(calls(kernel, capability))  # every function compiled is a caller, of none or more


def calls(kernel: StaticKernel, capability: int) -> dict[str, list[str]]:
    """{caller: [callee, ...]}: the front end's calls between the @triton.jit specialisations `kernel` compiles, one
    entry per call site (names as `called_functions`): which code is compiled once per call site and which once per
    branch, e.g. whether a mixed table's decode copies its codebook per rate."""
    module, _, _, _ = _front_end(kernel, capability)
    found: dict[str, list[str]] = {}
    caller = None
    for line in str(module).splitlines():
        function = re.search(_FUNCTION, line)
        if function:
            caller = _mangled_as_since_3_7(function.group(1) or function.group(2))
            found[caller] = []
        for quoted, bare in re.findall(_CALL, line):
            found[caller].append(_mangled_as_since_3_7(quoted or bare))
    return found


# Triton 3.6 (the lent GPU machine's) mangles a function's constexprs after its argument types, each as
# `(position,)cconstexpr_<value>_`, the name quoted in the IR: module.f__i64_i32__(2,)cconstexpr_4__(3,)cconstexpr_64_
# (and module.f__i64__ without one); from 3.7 each is `c<value>` in the argument list: module.f__i64_i32_c4_c64.
_CONSTEXPR_3_6 = re.compile(r"\([\d, ]+\)cconstexpr_(.*?)_(?=_\(|$)")


def _mangled_as_since_3_7(name: str) -> str:
    """`name` in the mangling Triton uses from 3.7 (unchanged when it is already): callers read one form whichever
    Triton compiled (for a function whose constexprs are its last arguments, the very name 3.7+ gives it)."""
    head, found, constants = name.partition("__(")
    if not found:
        return name.removesuffix("__") if name.count("__") > 1 else name
    values = "".join(f"_c{value}" for value in _CONSTEXPR_3_6.findall("(" + constants))
    return head + (values[1:] if head.endswith("__") else values)


def shared_bytes(kernel: StaticKernel, capability: int) -> int:
    """The shared memory Triton allocates for `kernel` on `capability`, from its compile up to LLVM IR: no PTX, no
    ptxas, so checking a variant against a target's limit costs a fraction of `compile_kernel` (the same
    `metadata.shared` a full compile reports)."""
    module, backend, options, language = _front_end(kernel, capability)
    stages: dict = {}
    backend.add_stages(stages, options, language)
    metadata: dict = {}
    for stage in ("ttir", "ttgir", "llir"):
        module = stages[stage](module, metadata)
    return int(metadata["shared"])


def ptxas_usage(compiled: Compiled) -> dict[str, int]:
    """registers and spill bytes from `ptxas -v`, run as Triton runs it (-lineinfo, --regAllocOptLevel=2)."""
    gpu_name = re.search(r"^\.target\s+(\w+)", compiled.ptx, re.M).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(compiled.ptx)
        log = subprocess.run(
            [compiled.ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={gpu_name}", str(src),
             "-o", str(Path(tmp) / "kernel.o")], capture_output=True, text=True, check=True,
        ).stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if not registers or not spills:
        raise ToolRunError(f"ptxas -v printed no register/spill line:\n{log}")
    return {"registers": int(registers.group(1)), "spills": int(spills.group(1)) + int(spills.group(2))}


def _param_index(kernel: StaticKernel) -> int:
    """Position of `trellis_arg` among the PTX entry's parameters (the runtime arguments, in order)."""
    runtime = [name for name in kernel.signature if name not in kernel.constexprs]
    if kernel.trellis_arg not in runtime:
        raise ToolInputError(
            f"{kernel.name}: trellis_arg {kernel.trellis_arg!r} is not a runtime argument of {runtime}"
        )
    return runtime.index(kernel.trellis_arg)


def _sass(cubin: bytes) -> str:
    """The cubin's code with ptxas's line info (`//## File "...", line N`), which finds the decode loop in it."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([_triton_tool("nvdisasm"), "-c", "-g", f.name], capture_output=True, text=True,
                              check=True).stdout


def analyse(kernel: StaticKernel, capability: int) -> dict:
    """One kernel's static facts on one target (the report's per-kernel entry)."""
    compiled = compile_kernel(kernel, capability)
    usage = {**ptxas_usage(compiled), "shared_bytes": compiled.shared_bytes, "num_warps": kernel.num_warps,
             "dtype": kernel.dtype}
    if kernel.trellis_arg is None:
        return {**usage, "trellis_load_bits": None, "ptx_per_weight": None, "sass_per_weight": None}
    loads = ptx_analysis.trellis_loads(compiled.ptx, _param_index(kernel), kernel.trellis_indirection)
    if not loads:
        raise ToolInputError(f"{kernel.name}: no global load derives from {kernel.trellis_arg!r} through "
                             f"{kernel.trellis_indirection} address load(s); is trellis_arg right?")
    weights_per_thread = kernel.weights_per_iteration / (kernel.num_warps * 32)
    sass_loop = ptx_analysis.decode_loop_sass_instructions(_sass(compiled.cubin),
                                                           ptx_analysis.source_lines(compiled.ptx, loads))
    return {
        **usage,
        "trellis_load_bits": min(ptx_analysis.load_bits(ld) for ld in loads),
        "ptx_per_weight": round(ptx_analysis.decode_loop_ptx_instructions(compiled.ptx, loads) / weights_per_thread, 2),
        "sass_per_weight": None if sass_loop is None else round(sass_loop / weights_per_thread, 2),
    }


def toolchain(capability: int) -> dict[str, str]:
    """The Triton and ptxas versions that compile for `capability` in this Python, stamped on what they measured:
    registers, spills, load widths, instruction counts and compile seconds are theirs. The lent GPU machine runs
    another Triton than the CPU proofs (3.6 there, ptxas 12.8 for sm_90 and ptxas-blackwell 12.9 for sm_120; 3.9
    here, ptxas 13.4 for both)."""
    import triton
    from triton.backends.nvidia.compiler import get_ptxas

    return {"triton": triton.__version__, "ptxas": get_ptxas(capability).version}


def _kernel_key(kernel: StaticKernel, capability: int) -> tuple:
    return (kernel.fn, tuple(sorted(kernel.signature.items())), tuple(sorted(kernel.constexprs.items())),
            kernel.num_warps, kernel.num_stages, tuple(sorted(kernel.options.items())), kernel.aligned, capability)


def _launched(kernels: list[StaticKernel], shape: LayerShape, target: str, capability: int) -> list[StaticKernel]:
    """The variants `target`'s launches take (`StaticKernel.launched_on`), refused where two share a name: the report
    would keep one of them silently."""
    launched = [k for k in kernels if k.launched_on is None or k.launched_on(capability)]
    names = [k.name for k in launched]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ToolInputError(f"{shape.model} on {target}: more than one variant named {repeated}; "
                             "say which target launches each (StaticKernel.launched_on)")
    return launched


def _each_variant(kernels_for: Callable[[LayerShape], list[StaticKernel]], shapes: Iterable[LayerShape],
                  measure: Callable[[StaticKernel, int], object], announce: bool = False) -> dict[str, dict]:
    """{"sm_90": {"<model>/<kernel>": measure(kernel, capability)}, ...} over every variant each target launches;
    identical compiles are measured once. In-process: Triton must not be running its interpreter here."""
    done: dict[tuple, object] = {}
    targets = {}
    for target, capability in TARGETS.items():
        found = {}
        for shape in shapes:
            for kernel in _launched(kernels_for(shape), shape, target, capability):
                key = _kernel_key(kernel, capability)
                if key not in done:
                    if announce:
                        print(f"compiling {kernel.name} for {target}", file=sys.stderr, flush=True)
                    done[key] = measure(kernel, capability)
                found[f"{shape.model}/{kernel.name}"] = done[key]
        targets[target] = found
    return targets


def compile_targets(kernels_for: Callable[[LayerShape], list[StaticKernel]], shapes: Iterable[LayerShape]) -> dict:
    """{"sm_90": {"kernels": {"<model>/<kernel>": facts}, "triton": version, "ptxas": version}, "sm_120": ...}:
    `analyse` of every variant, stamped with the `toolchain` that compiled them."""
    return {target: {"kernels": kernels, **toolchain(TARGETS[target])}
            for target, kernels in _each_variant(kernels_for, shapes, analyse, announce=True).items()}


def shared_targets(kernels_for: Callable[[LayerShape], list[StaticKernel]], shapes: Iterable[LayerShape]) -> dict:
    """{"sm_90": {"<model>/<kernel>": shared bytes}, ...}: `shared_bytes` of every variant each target launches."""
    return _each_variant(kernels_for, shapes, shared_bytes)


def call_targets(kernels_for: Callable[[LayerShape], list[StaticKernel]], shapes: Iterable[LayerShape]) -> dict:
    """{"sm_90": {"<model>/<kernel>": {caller: [callees]}}, ...}: `calls` of every variant each target launches."""
    return _each_variant(kernels_for, shapes, calls)


def function_targets(kernels_for: Callable[[LayerShape], list[StaticKernel]], shapes: Iterable[LayerShape]) -> dict:
    """{"sm_90": {"<model>/<kernel>": [called function specialisations]}, ...}: `called_functions` of every variant."""
    return _each_variant(kernels_for, shapes, called_functions)


_MODES = {"compile": compile_targets, "shared": shared_targets, "functions": function_targets, "calls": call_targets}


def compile_report(provider: str, shapes: Iterable[LayerShape], mode: str = "compile") -> dict:
    """`compile_targets` (mode "compile"), `shared_targets` ("shared"), `function_targets` ("functions") or
    `call_targets` ("calls") of `provider` ("module:function" or "file.py:function", shape -> list[StaticKernel]) in
    a child Python with Triton's compiler, whatever mode this process runs Triton in."""
    return run_json(__name__, [mode, provider, json.dumps([asdict(s) for s in shapes])], triton_interpret=False)


if __name__ == "__main__":
    _shapes = [LayerShape(**s) for s in json.loads(sys.argv[3])]
    print(json.dumps(_MODES[sys.argv[1]](resolve(sys.argv[2]), _shapes)))
