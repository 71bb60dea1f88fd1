"""`bench-kernels --static`: the report's layout and the Triton kernel's targets (32-bit trellis loads, at most 10 PTX
instructions per MUL1 weight at K=3, no spills), the launch counts (3 per MoE forward up to 64 tokens, the fused
kernels), and kernels whose facts are known: the former gather decode (16-bit loads, 38 SASS instructions per MUL1
weight, as issue #24 read them), probes with 32- vs 16-bit trellis loads beside 8-bit activation loads, an exact
instruction surplus, a loop nested in the decode loop (moe_down's partial sums), and a table holding a trellis
address beside an offset into another array (the dense kernel's suh/svh)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from vllm_expert_offload import cli
from vllm_expert_offload.kernels.static_spec import LayerShape, StaticKernel
from vllm_expert_offload.tools import bench_kernels_cmd, compile_census, ptx_analysis, static_kernels, static_report

from support.lent_toolchain import LENT, pretend_lent_toolchain

PROBES = str(Path(__file__).with_name("static_probe_kernels.py"))
TINY = LayerShape("tiny", hidden=128, intermediate=128, experts=4, top_k=2)


@pytest.fixture(scope="module")
def probes() -> dict:
    return static_kernels.compile_report(f"{PROBES}:probe_kernels", [TINY])


@pytest.mark.parametrize("target", ["sm_90", "sm_120"])
def test_trellis_load_width_follows_the_table_not_the_activations(probes, target) -> None:
    kernels = probes[target]["kernels"]
    assert kernels["tiny/probe[32,0]"]["trellis_load_bits"] == 32  # the 8-bit activation loads are not trellis
    assert kernels["tiny/probe[16,0]"]["trellis_load_bits"] == 16


@pytest.mark.parametrize("target", ["sm_90", "sm_120"])
def test_decode_loop_count_sees_every_added_instruction(probes, target) -> None:
    kernels = probes[target]["kernels"]
    # probe[32,10]'s loop body carries 10 adds and a mov more, inline asm on one line (1 weight per thread)
    assert kernels["tiny/probe[32,10]"]["ptx_per_weight"] - kernels["tiny/probe[32,0]"]["ptx_per_weight"] == 11
    # a runtime branch in the loop (arms of 12 and 13 asm statements): both arms count, also where LLVM places blocks
    # of the loop before its header
    assert kernels["tiny/probe[32,10,branch]"]["ptx_per_weight"] >= kernels["tiny/probe[32,10]"]["ptx_per_weight"] + 12


@pytest.mark.parametrize("target", ["sm_90", "sm_120"])
def test_table_offset_into_another_array_is_not_trellis(probes, target) -> None:
    kernels = probes[target]["kernels"]
    # field 1 offsets the fp16 `scale_ptr` array (as linear_kernel's suh_at): its 16-bit loads are not trellis
    assert kernels["tiny/table[offset]"]["trellis_load_bits"] == 32
    # the twin: field 1 is itself an address of 16-bit words, a trellis address like field 0
    assert kernels["tiny/table[address]"]["trellis_load_bits"] == 16


@pytest.mark.parametrize("target", ["sm_90", "sm_120"])
def test_decode_loop_holds_the_loop_nested_in_it(probes, target) -> None:
    kernels = probes[target]["kernels"]
    plain, nested = kernels["tiny/probe[32,10]"], kernels["tiny/probe[32,10,nested]"]
    # the nested loop's body has 14 asm statements (add, 12 adds, mov) besides its load and control: all count
    assert nested["ptx_per_weight"] - plain["ptx_per_weight"] >= 14
    # SASS: the decode loop (trellis loads by line info) with the nested one inside it, not the nested loop alone
    assert nested["sass_per_weight"] > plain["sass_per_weight"]


_TABLE_PTX = """.entry k(
\t.param .u64 .ptr .global .align 1 k_param_0,
\t.param .u64 .ptr .global .align 1 k_param_1,
\t.param .u64 k_param_2
)
ld.param.b64 %rd1, [k_param_0];
ld.param.b64 %rd4, [k_param_1];
ld.param.b64 %rd8, [k_param_2];
ld.global.b64 %rd2, [%rd1];
ld.global.b64 %rd3, [%rd1+8];
ld.global.b32 %r1, [%rd2];
shl.b64 %rd5, %rd3, 1;
add.s64 %rd6, %rd4, %rd5;
ld.global.b16 %rs1, [%rd6];
add.s64 %rd9, %rd8, %rd5;
ld.global.b16 %rs2, [%rd9];
"""


def test_only_another_pointer_parameter_makes_a_table_offset_foreign() -> None:
    # %rs1: suh-like (pointer param 1 + table offset); %rs2: the same offset plus a 64-bit integer param: trellis
    loads = ptx_analysis.trellis_loads(_TABLE_PTX, 0, 1)
    assert [ld.operands.split(",")[0] for ld in loads] == ["%r1", "%rs2"]
    assert ptx_analysis.pointer_params(_TABLE_PTX) == {0, 1}


# One kernel's front-end IR as Triton 3.6 (the lent GPU machine's) prints it and as 3.7+ do: 3.6 quotes the names of
# functions called with constexprs and mangles each as `(position,)cconstexpr_<value>_` after the argument types.
_IR_3_6 = """  tt.func public @k(%a: i64) {
  tt.func private @"m.group_words__i64_i32__(2,)cconstexpr_4__(3,)cconstexpr_64_"(%t: i64, %k: i32) -> i32 {
  tt.func private @"m._codebook__u32S4_8S__(1,)cconstexpr_-6_"(%s: tensor<4x8xi32>) -> tensor<4x8xf16> {
  tt.func private @m._mul1__u32S4_8S__(%s: tensor<4x8xi32>) -> tensor<4x8xf16> {
  tt.func private @"m.flag____(0,)cconstexpr_True_"() {
"""
_IR_3_9 = """  tt.func public @k(%a: i64) {
  tt.func private @m.group_words__i64_i32_c4_c64(%t: i64, %k: i32) -> i32 {
  tt.func private @m._codebook__u32S4_8S_c-6(%s: tensor<4x8xi32>) -> tensor<4x8xf16> {
  tt.func private @m._mul1__u32S4_8S(%s: tensor<4x8xi32>) -> tensor<4x8xf16> {
  tt.func private @m.flag__cTrue() {
"""


@pytest.mark.parametrize("ir", [_IR_3_6, _IR_3_9], ids=["triton-3.6", "triton-3.9"])
def test_called_functions_read_alike_under_each_triton(ir: str, monkeypatch) -> None:
    """test_mixed_rates.py reads which rates a kernel compiles from these names: under 3.6 a regex for 3.9's bare
    names found none of the constexpr-specialised functions (the decode's), so it saw no kernel decode at all."""
    monkeypatch.setattr(static_kernels, "_front_end", lambda kernel, capability: (ir, None, None, None))
    assert static_kernels.called_functions(None, 90) == sorted(
        ["k", "m.group_words__i64_i32_c4_c64", "m._codebook__u32S4_8S_c-6", "m._mul1__u32S4_8S", "m.flag__cTrue"])


def test_report_says_which_triton_and_ptxas_compiled_each_target(monkeypatch) -> None:
    """Registers, spills, load widths and instruction counts are one Triton's and one ptxas's: each target's entry and
    summary line name them (the lent machine's Triton 3.6 compiles sm_90 with ptxas 12.8, sm_120 with 12.9)."""
    pretend_lent_toolchain(monkeypatch)
    monkeypatch.setattr(static_kernels, "analyse", lambda kernel, capability: {})  # nothing compiled
    kernel = StaticKernel("k", None, {"ptr": "*i16"}, {}, 4, 1, 8, "ptr")
    targets = static_kernels.compile_targets(lambda shape: [kernel], [TINY])
    assert targets == {"sm_90": {"kernels": {"tiny/k": {}}, **LENT[90]},
                       "sm_120": {"kernels": {"tiny/k": {}}, **LENT[120]}}
    census = {"count": 1, "by_kernel": {"k": 1}}
    report = {"targets": {"sm_120": {"kernels": {}, **LENT[120]}}, "launches": {}, "estimates": {},
              "dequantize_estimates": {}, "compile_census": {"sm_90": {
                  "counted": {**census, "toolchain": {"triton": "3.6.0"}},
                  "compiled": {**census, "toolchain": LENT[90], "compile_s": 1.0, "shared_bytes_max": 0,
                               "shared_limit": 232448, "variants_over_limit": 0}}}}
    lines = static_report.summary_lines(report)
    assert lines[0] == "sm_120 (Triton 3.6.0, ptxas 12.9):"
    assert [line.split(":")[0] for line in lines if line.startswith("CENSUS")] == [
        "CENSUS sm_90 counted (Triton 3.6.0)", "CENSUS sm_90 compiled (Triton 3.6.0, ptxas 12.8)"]


def test_sass_loop_without_line_info_is_refused() -> None:
    sass = ".L_x_0:\n        /*0000*/ LDG.E R4, desc[UR4][R4.64] ;\n        /*0010*/ BRA `(.L_x_0) ;\n"
    with pytest.raises(ValueError, match="line info"):
        ptx_analysis.decode_loop_sass_instructions(sass, {("k.py", 1)})


def test_former_gather_decode_reads_16_bit_at_38_sass_instructions_per_weight(probes) -> None:
    legacy = probes["sm_90"]["kernels"]["tiny/legacy[mul1,fp16]"]
    assert legacy["trellis_load_bits"] == 16
    assert 36 <= legacy["sass_per_weight"] <= 40 and 26 <= legacy["ptx_per_weight"] <= 30


@pytest.mark.parametrize("target", ["sm_90", "sm_120"])
def test_aligned_arguments_are_compiled_as_a_launch_specialises_them(probes, target) -> None:
    kernels = probes[target]["kernels"]
    # 8 contiguous 16-bit words per thread: one 128-bit load once the pointer and the row stride are both known to
    # be multiples of 16 (as Triton's launch finds them), 16-bit loads while either is not
    assert kernels["tiny/strided[]"]["trellis_load_bits"] == 16
    assert kernels["tiny/strided[trellis_ptr]"]["trellis_load_bits"] == 16
    assert kernels["tiny/strided[trellis_ptr,stride]"]["trellis_load_bits"] == 128


def test_a_variant_is_compiled_for_the_targets_that_launch_it(probes) -> None:
    assert "tiny/strided[sm_120 only]" in probes["sm_120"]["kernels"]
    assert "tiny/strided[sm_120 only]" not in probes["sm_90"]["kernels"]


def test_two_variants_of_one_name_on_one_target_are_refused() -> None:
    twins = [StaticKernel("k", None, {"ptr": "*i16"}, {"BLOCK": block}, 4, 1, 8, "ptr") for block in (8, 16)]
    with pytest.raises(ValueError, match=r"tiny on sm_90: more than one variant named \['k'\]"):
        static_kernels.compile_targets(lambda shape: twins, [TINY])


def test_aligned_names_must_be_runtime_arguments() -> None:
    kernel = StaticKernel("k", None, {"ptr": "*i16"}, {"BLOCK": 8}, 4, 1, 8, "ptr", aligned=("BLOCK",))
    with pytest.raises(ValueError, match=r"aligned \['BLOCK'\] are not runtime arguments"):
        static_kernels._alignment_attrs(kernel)


def test_wrong_trellis_argument_is_refused() -> None:
    ptx = "ld.param.b64 %rd1, [k_param_0];\nld.global.b64 %rd2, [%rd1];\nld.global.b16 %rs1, [%rd2];\n"
    assert [ld.opcode for ld in ptx_analysis.trellis_loads(ptx, 0, 1)] == ["ld.global.b16"]
    assert ptx_analysis.trellis_loads(ptx, 1, 1) == []  # another parameter reads nothing of the trellis
    assert [ld.opcode for ld in ptx_analysis.trellis_loads(ptx, 0, 0)] == ["ld.global.b64"]  # the table itself


def test_report_layout_and_todays_kernel(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(bench_kernels_cmd, "TRITON_KERNELS", f"{PROBES}:today_mul1")
    monkeypatch.setattr(bench_kernels_cmd, "estimate_kernel", lambda shape: "exl3_matmul[mul1,fp16]")
    monkeypatch.setattr(bench_kernels_cmd, "dequantize_kernels", lambda shape: ("exl3_matmul[mul1,fp16]",) * 2)
    monkeypatch.setattr(static_report, "SHAPES", static_report.SHAPES[:1])
    # the census counts here; compiling its variants takes minutes per model (a mixed-K one, hours): a tool run
    monkeypatch.setattr(compile_census, "census_report", functools.partial(compile_census.census_report,
                                                                          compile_variants=False))
    out = tmp_path / "static.json"
    assert cli.main(["bench-kernels", "--static", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["compile_census"], "the census is part of the report"
    assert set(report["targets"]) == {"sm_90", "sm_120"}
    running = {target: static_kernels.toolchain(capability) for target, capability in static_kernels.TARGETS.items()}
    assert {target: {"triton": e["triton"], "ptxas": e["ptxas"]} for target, e in report["targets"].items()} == running
    assert all(c["toolchain"]["triton"] == running[target]["triton"]
               for target, per_model in report["compile_census"].items() for c in per_model.values())
    assert set(report["launches"]) == {"moe_1", "moe_8", "moe_64", "dense_1"}
    for target in ("sm_90", "sm_120"):
        facts = report["targets"][target]["kernels"]["Qwen3-30B-A3B/exl3_matmul[mul1,fp16]"]
        assert {"registers", "spills", "shared_bytes", "trellis_load_bits", "ptx_per_weight"} <= set(facts)
        assert facts["trellis_load_bits"] >= 32 and facts["spills"] == 0 and 0 < facts["registers"] <= 255
        assert facts["ptx_per_weight"] <= 10
        estimate = report["estimates"][target]["Qwen3-30B-A3B"]
        assert estimate["pcie_floor_us"] > estimate["hbm_floor_us"] > 0
        prefill = report["dequantize_estimates"][target]["Qwen3-30B-A3B"]
        assert prefill["bound"] in ("memory", "issue") and prefill["issue_us"] > 0 and prefill["memory_us"] > 0
    # the backend's fused kernels (issue #24): three launches per MoE forward up to 64 tokens, no torch op; a dense
    # linear in one (two where its input is split to fill a GPU; the CPU census never splits)
    assert report["launches"] == {"moe_1": 3, "moe_8": 3, "moe_64": 3, "dense_1": 1}


def test_dequantize_estimate_is_issue_time_beside_memory_time() -> None:
    """Exact arithmetic: one expert of 3 matrices 1024 x 512 at K=3 (2.375 bytes of traffic per weight) on a GPU of
    1 SM at 1 GHz (128 thread-instructions per ns) and 1 GB/s (1 byte per ns)."""
    gpu = static_report.Gpu("toy", sms=1, boost_ghz=1.0, hbm_gbs=1.0, pcie_gbs=1.0)
    shape = LayerShape("toy", hidden=1024, intermediate=512, experts=1, top_k=1)
    matrix = 1024 * 512
    folded, plain = {"sass_per_weight": 20.0, "ptx_per_weight": 99.0}, {"sass_per_weight": 8.0, "ptx_per_weight": 99.0}
    got = static_report.dequantize_estimate(shape, folded, plain, gpu)
    assert got["issue_us"] == round(matrix * (2 * 20 + 8) / 128 / 1e3, 1)
    assert got["memory_us"] == round(3 * matrix * 2.375 / 1e3, 1)
    assert got["bound"] == "memory" and got["weights"] == 3 * matrix
    slow = static_report.dequantize_estimate(shape, {"sass_per_weight": 1000.0}, plain, gpu)
    assert slow["bound"] == "issue"  # 1 SM issuing 1,000 instructions per weight outlasts the memory


def test_model_shapes_match_the_fixture_configs() -> None:
    fixtures = Path(__file__).parents[1] / "fixtures"
    v41 = json.loads((fixtures / "deepseek_v41_flash" / "config.json").read_text())["text_config"]
    qwen, dsv41 = static_report.SHAPES
    assert (dsv41.hidden, dsv41.intermediate * 2, dsv41.experts, dsv41.top_k) == (
        v41["hidden_size"], v41["moe_intermediate_size"], v41["n_routed_experts"], v41["num_experts_per_tok"])
    q = json.loads((fixtures / "qwen3_30b_a3b" / "config.json").read_text())
    assert (qwen.hidden, qwen.intermediate, qwen.experts, qwen.top_k) == (
        q["hidden_size"], q["moe_intermediate_size"], q["num_experts"], q["num_experts_per_tok"])
