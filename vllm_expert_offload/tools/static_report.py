"""The static kernel report: every kernel the Triton backend launches, compiled for sm_90 and sm_120 at the shapes of
the models the plugin targets (tools/static_kernels.py), the launch census of its forwards (tools/launch_census.py),
and from both an estimate of the decode time per MoE layer beside the memory floors.

The estimate is arithmetic on published GPU figures, not a measurement: the decode loop's SASS instructions per
weight over the GPU's issue rate (4 warp-instructions per SM per clock, every SM busy), floored by the trellis bytes
over HBM and over PCIe, plus ~2 µs per launch (a CUDA-graph node; issue #24's 0.2-0.3 ms per ~130 nodes).
The same arithmetic for a prefill's decode-once kernel (triton_dequantize.py): one expert decoded into fp16, its
issue time beside the time its memory traffic takes (trellis in, fp16 out), and which of the two bounds it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from ..kernels.static_spec import LayerShape

# Shapes of one MoE layer per model and rank, from the models' config.json (tests/fixtures/*/config.json).
SHAPES = (
    LayerShape("Qwen3-30B-A3B", hidden=2048, intermediate=768, experts=128, top_k=8),
    # DeepSeek-V4.1-Flash at TP 2: moe_intermediate_size 2304 split over two ranks, every expert on each.
    LayerShape("DeepSeek-V4.1-Flash-TP2", hidden=5120, intermediate=1152, experts=384, top_k=6),
)


@dataclass(frozen=True)
class Gpu:
    name: str
    sms: int
    boost_ghz: float
    hbm_gbs: float
    pcie_gbs: float  # practical host-to-device read rate


# Published figures. H200 SXM: 132 SMs (the GH100 configuration of NVIDIA's Hopper architecture whitepaper), boost
# 1.98 GHz (TechPowerUp GPU database, "NVIDIA H200 SXM 141 GB"), HBM3e 4.8 TB/s (NVIDIA H200 datasheet). RTX PRO 6000
# Blackwell: 24,064 CUDA cores = 188 SMs x 128 and 1,792 GB/s GDDR7 (NVIDIA RTX PRO 6000 Blackwell datasheet), boost
# 2.617 GHz (TechPowerUp). Both PCIe 5.0 x16: 51.5 GB/s practical, as docs/benchmarks.md's placement estimate uses.
GPUS = {
    "sm_90": Gpu("H200 SXM", 132, 1.98, 4800.0, 51.5),
    "sm_120": Gpu("RTX PRO 6000 Blackwell", 188, 2.617, 1792.0, 51.5),
}
LAUNCH_US = 2.0


def estimate(shape: LayerShape, facts: dict, gpu: Gpu, launches: int) -> dict:
    """Estimated µs of one MoE layer forward at 1 token (top_k experts' gate, up and down) on `gpu`."""
    weights = shape.top_k * 3 * shape.hidden * shape.intermediate
    trellis_bytes = weights * shape.k_bits / 8
    issue_us = _issue_us(weights * _per_weight(facts), gpu)
    hbm_us = trellis_bytes / (gpu.hbm_gbs * 1e3)
    pcie_us = trellis_bytes / (gpu.pcie_gbs * 1e3)
    return {
        "gpu": gpu.name, "weights": weights, "trellis_bytes": int(trellis_bytes),
        "decode_issue_us": round(issue_us, 1), "launch_us": launches * LAUNCH_US,
        "predicted_us": round(max(issue_us, hbm_us) + launches * LAUNCH_US, 1),
        "hbm_floor_us": round(hbm_us, 1), "pcie_floor_us": round(pcie_us, 1),
    }


def _per_weight(facts: dict) -> float:
    """A kernel's decode-loop instructions per weight: SASS (what the GPU issues) where the report found the loop
    in it, else PTX."""
    return facts["sass_per_weight"] or facts["ptx_per_weight"]


def _issue_us(weight_instructions: float, gpu: Gpu) -> float:
    """µs to issue `weight_instructions` (weights x instructions per weight per thread) with every SM busy."""
    return weight_instructions / 32 / (gpu.sms * 4 * gpu.boost_ghz * 1e3)


def dequantize_estimate(shape: LayerShape, folded: dict, plain: dict, gpu: Gpu) -> dict:
    """Estimated µs to decode one expert once into fp16 on `gpu` (gate and up with the input rotation folded,
    `folded`'s facts; down as decoded, `plain`'s): the instructions' issue time beside the memory time of the
    kernel's traffic (the trellis read, the fp16 weights written). Why: the kernel writes 2 bytes per weight, so its
    instruction count costs time only where issuing them takes longer than the memory does."""
    matrix = shape.hidden * shape.intermediate
    issue_us = _issue_us(matrix * (2 * _per_weight(folded) + _per_weight(plain)), gpu)
    memory_us = 3 * matrix * (2 + shape.k_bits / 8) / (gpu.hbm_gbs * 1e3)
    return {"gpu": gpu.name, "weights": 3 * matrix, "issue_us": round(issue_us, 1),
            "memory_us": round(memory_us, 1), "bound": "memory" if memory_us >= issue_us else "issue"}


def dequantize_estimates(targets: dict, kernel_names: Callable[[LayerShape], tuple[str, str]]) -> dict:
    """Per target and model: `dequantize_estimate` of the (folded, plain) kernels `kernel_names(shape)` names."""
    return {target: {shape.model: dequantize_estimate(
        shape, *(targets[target]["kernels"][f"{shape.model}/{name}"] for name in kernel_names(shape)), gpu)
        for shape in SHAPES} for target, gpu in GPUS.items()}


def estimates(targets: dict, launches: dict, kernel_name: Callable[[LayerShape], str]) -> dict:
    """Per target and model: the estimate for the kernel `kernel_name(shape)` names (the decode-path variant)."""
    out = {}
    for target, gpu in GPUS.items():
        out[target] = {shape.model: estimate(shape, targets[target]["kernels"][f"{shape.model}/{kernel_name(shape)}"],
                                             gpu, launches["moe_1"]) for shape in SHAPES}
    return out


def summary_lines(report: dict) -> list[str]:
    lines = []
    for target, entry in report["targets"].items():
        lines.append(f"{target} ({_measured_by(entry)}):")
        for name, f in entry["kernels"].items():
            reads = "reads no trellis" if f["trellis_load_bits"] is None else (
                f"trellis loads {f['trellis_load_bits']}-bit, {f['ptx_per_weight']} PTX / {f['sass_per_weight']} SASS "
                "instructions per weight")
            lines.append(f"  {name}: {f['registers']} regs, {f['spills']} B spilled, {f['shared_bytes']} B shared, "
                         + reads)
    lines.append("launches: " + ", ".join(f"{k} {v}" for k, v in report["launches"].items()))
    for target, per_model in report["estimates"].items():
        for model, e in per_model.items():
            lines.append(f"ESTIMATE {target} ({e['gpu']}) {model}, one MoE layer at 1 token: {e['predicted_us']} µs "
                         f"(decode issue {e['decode_issue_us']} + launches {e['launch_us']}); floors: HBM "
                         f"{e['hbm_floor_us']} µs, PCIe {e['pcie_floor_us']} µs (all experts host-tier)")
    for target, per_model in report.get("compile_census", {}).items():
        for model, c in per_model.items():
            compiled = (f"{c['compile_s']} s to compile here, shared memory at most {c['shared_bytes_max']} B of "
                        f"{c['shared_limit']} B ({c['variants_over_limit']} over)") if "compile_s" in c else \
                "counted, not compiled"
            lines.append(f"CENSUS {target} {model} ({_measured_by(c['toolchain'])}): {c['count']} variants at startup ("
                         + ", ".join(f"{k} {n}" for k, n in c["by_kernel"].items()) + f"), {compiled}")
    for target, per_model in report["dequantize_estimates"].items():
        for model, e in per_model.items():
            lines.append(f"ESTIMATE {target} ({e['gpu']}) {model}, one expert decoded once for a prefill (gate and up "
                         f"folded): issue {e['issue_us']} µs, memory {e['memory_us']} µs: bound by {e['bound']}")
    return lines


def _measured_by(toolchain: dict) -> str:
    """"Triton 3.6.0, ptxas 12.8": what compiled (or, without ptxas, only specialised) the kernels a line is about."""
    ptxas = f", ptxas {toolchain['ptxas']}" if "ptxas" in toolchain else ""
    return f"Triton {toolchain['triton']}{ptxas}"


def shapes_json() -> list[dict]:
    return [asdict(shape) for shape in SHAPES]
