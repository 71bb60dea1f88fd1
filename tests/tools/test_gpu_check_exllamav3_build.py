"""scripts/build-exllamav3-ext.py's generated parts, on the CPU without building anything: the op schemas against the
backend's SIGNATURES (which tests/kernels/test_exllamav3_signatures.py checks against exllamav3's headers), the marks on
the tensors each kernel writes, the instance units and null tables of a trimmed rate set, the trim of exl3_gemv.cu's
selector, and the rate sets it refuses to build. The build itself (nvcc, minutes) is run by hand; where its output
exists here, its own checks must have passed."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from vllm_expert_offload.kernels.exllamav3_backend import OPTIONAL_TENSOR, SIGNATURES, TENSOR

from support.paths import REPO


def _load():
    spec = importlib.util.spec_from_file_location("build_exllamav3_ext", REPO / "scripts" / "build-exllamav3-ext.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


build = _load()
TESTED = build.Rates((3,), (4,), ("mul1",))


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_op_schemas_take_the_backends_arguments_in_order_and_mark_exactly_the_written_tensors(name: str) -> None:
    schema = torch._C.parse_schema(build.op_schema(name))
    assert [a.name for a in schema.arguments] == [arg for arg, _ in SIGNATURES[name]]
    kinds = dict(SIGNATURES[name])
    for argument in schema.arguments:
        want = {TENSOR: "Tensor", OPTIONAL_TENSOR: "Optional[Tensor]"}.get(kinds[argument.name])
        if want is not None:
            assert str(argument.type) == want
        written = argument.alias_info is not None and argument.alias_info.is_write
        assert written == (argument.name in build.WRITES.get(name, ())), argument
    assert [str(r.type) for r in schema.returns] == (["int"] if name in build.RETURNS else [])


def test_every_written_name_is_an_argument() -> None:
    """A misspelt name in WRITES would silently leave a written tensor unmarked."""
    for name, written in build.WRITES.items():
        assert written <= {arg for arg, _ in SIGNATURES[name]}, name


def test_the_tested_rates_get_one_unit_per_kernel_instance_and_null_for_every_other() -> None:
    units = build.generated_units(TESTED)
    assert sorted(n for n in units if n.startswith("trim_gemm_k")) == [f"trim_gemm_k4_cb2_s{s}.cu" for s in range(1, 8)]
    assert "trim_moe_kernel_k3_n128_cb2.cu" in units and "trim_moe_kernel_k3_n256_cb2.cu" in units
    assert sorted(n for n in units if n.startswith("trim_coop_k")) == ["trim_coop_k3.cu"]
    text = "\n".join(units.values())
    for k in range(1, 9):  # every table exllamav3's kernel map and MoE tables name, defined once
        for kind in ("gemm", "mgemm"):
            for fp in ("fp32", "fp16"):
                for cb in range(3):
                    assert len(re.findall(rf"\btfp_exl3_{kind}_kernel_{fp}_b{k}_cb{cb}\[", text)) == 1
        for cb in (1, 2):
            for n in (128, 256):
                assert len(re.findall(rf"fp_exl3_moe_kernel exl3_moe_kernel_k{k}_n{n}_cb{cb}\(\)", text)) == 1
        assert len(re.findall(rf"MoeCoopKernel exl3_moe_coop_kernel_a_k{k}\(", text)) == 1
    assert "exl3_gemm_kernel<4, false, true, 2, EXL3_GEMM_SHAPE_1>" in units["trim_gemm_k4_cb2_s1.cu"]
    assert "return exl3_moe_kernel<3, 256, 2>;" in units["trim_moe_kernel_k3_n256_cb2.cu"]
    assert "exl3_moe_coop_a_kernel<3, 2, true>" in units["trim_coop_k3.cu"]
    assert "exl3_moe_coop_a_kernel<3, 1" not in units["trim_coop_k3.cu"]  # MCG was not asked for


def test_the_registration_refuses_what_was_not_built() -> None:
    source = build.registration(TESTED)
    assert "static const Rates moe_rates = {{6, 2}};" in source and "gemm_rates = {{8, 2}};" in source
    assert source.count("trim_require(") == 1 + 4  # the definition, coop twice, moe, gemm
    half = build.registration(build.Rates((2.5,), (4,), ("mul1",)))
    assert "moe_rates = {{5, 2}};" in half


def test_the_gemv_selector_keeps_the_fp32_instances_of_the_built_rates_only() -> None:
    shipped = ("    SEL_GRID(4, 0, false) SEL_GRID(4, 1, false) SEL_GRID(4, 2, false)\n"
               "    SEL_GRID(2, 1, false) SEL_GRID(2, 2, false) SEL_GRID(2, 1, true) SEL_GRID(2, 2, true)\n"
               "    SEL_GRID(3, 1, false) SEL_GRID(3, 2, false) SEL_GRID(3, 1, true) SEL_GRID(3, 2, true)\n")
    trimmed = build.trim_gemv_selector("before\n" + shipped + "after\n", TESTED)
    assert trimmed == ("before\n    SEL(4, 2, true, 0, 0, false) SEL(4, 2, true, 0, 1, false) SEL(4, 2, true, 1, 0, false) "
                       "SEL(4, 2, true, 1, 1, false)\nafter\n")
    assert "SEL_GRID" not in build.trim_gemv_selector(shipped, build.Rates((3,), (5,), ("mul1",)))  # no GEMV at K=5
    with pytest.raises(SystemExit, match="SEL_GRID list to trim is not where 1.6.5 has it"):
        build.trim_gemv_selector(shipped.replace("SEL_GRID(3, 2, true)", "SEL_GRID(3, 2, TRUE)"), TESTED)


@pytest.mark.parametrize(("rates", "why"), [
    (build.Rates((2.5,), (4,), ("mcg", "mul1")), "half-integer rates exist for the mul1 codebook only"),
    (build.Rates((9,), (4,), ("mul1",)), "9 is not an EXL3 rate"),
    (build.Rates((3,), (4,), ("q4",)), "unknown"),
])
def test_rate_sets_exllamav3_has_no_kernels_for_are_refused(rates, why) -> None:
    with pytest.raises(SystemExit, match=why):
        rates.check()


def test_a_build_here_passed_its_own_checks() -> None:
    manifest = REPO / ".gpucheck" / "exllamav3_ext" / "manifest.json"
    if not manifest.exists():
        pytest.skip("no trimmed extension built in this checkout (scripts/build-exllamav3-ext.sh)")
    facts = json.loads(manifest.read_text())
    assert facts["problems"] == [] and facts["bytes"] < build.LIMIT_BYTES and "90" in facts["sass_arches"]
    assert set(facts["needed"]) <= build.ALLOWED_NEEDED and facts["functions"] == sorted(SIGNATURES)


def test_a_build_that_cannot_load_here_is_an_import_error_the_backend_reports() -> None:
    """Under this machine's CPU torch (no libc10_cuda, another torch) the library cannot load: the package says so as
    an ImportError, which the backend turns into its reason for being unavailable, instead of crashing the import."""
    package = REPO / ".gpucheck"
    if not (package / "exllamav3_ext" / "_C.so").exists():
        pytest.skip("no trimmed extension built in this checkout (scripts/build-exllamav3-ext.sh)")
    code = ("import torch\nfrom vllm_expert_offload.kernels.exllamav3_backend import exllamav3_unavailable\n"
            "print(exllamav3_unavailable(torch.device('cuda', 0)))")
    env = {**os.environ, "PYTHONPATH": f"{package}:{REPO}"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "the trimmed exllamav3_ext at" in result.stdout and f"does not load under torch {torch.__version__}" in (
        result.stdout)
