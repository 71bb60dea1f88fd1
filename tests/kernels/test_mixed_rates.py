"""A layer whose experts mix rates compiles only the rates (and codebooks) it holds, and per rate only the states
(issue #38, compile time).

The decode branches per matrix on a mixed table's K and codebook at run time, and each branch is compiled at every
call site (gate/up has eight, down four). With a branch for every rate EXL3 has (11), one mixed-K gate/up variant took
2,558 s to compile for sm_90, ~50x a uniform one's (51.6 s). The tables' constexprs now name the values present
(matrix_table.present_key) and the decode compiles a branch for those alone; with the whole decode in each rate's
branch a K = 2/3/4 layer still took 2.0x a uniform one's, so a rate's branch now holds its states alone and the
codebook and permutation follow it once. Checked on the front end's IR of the variants a real (meta) forward
launches: which specialisations of the decode's functions it calls, and from where; not a timing."""

from __future__ import annotations

import itertools
import re
from collections import Counter
from pathlib import Path

from vllm_expert_offload.kernels import triton_decode
from vllm_expert_offload.kernels.matrix_table import present_key, present_values
from vllm_expert_offload.kernels.static_spec import LayerShape
from vllm_expert_offload.tools import static_kernels

_RATES = (2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16)  # 2K of every EXL3 rate


def _constexprs(functions: list[str], name: str) -> set[int]:
    """The constexpr each specialisation of triton_decode.`name` was compiled for (the decode's rate for
    group_words, the codebook id for _codebook): the first `c<value>` of Triton's mangled name."""
    found = set()
    for function in functions:
        match = re.fullmatch(rf"vllm_expert_offload\.kernels\.triton_decode\.{name}__[^c]*?_c(\d+)\w*", function)
        if match:
            found.add(int(match.group(1)))
    return found


def test_a_mixed_layers_kernels_compile_its_rates_alone() -> None:
    """Every variant of a K = 2 (MUL1) / K = 3 (MCG) layer that decodes (gate/up, down, dequantize; at decode and
    prefill) reads trellises at 2K = 4 and 6 and through MUL1 (2) and MCG (1) only: no branch of another rate or of
    3INST is in its IR."""
    provider = f"{Path(__file__).with_name('mixed_rate_variants.py')}:mixed_layer_variants"
    functions = static_kernels.compile_report(provider, [LayerShape("mixed-2-3", 256, 256, 4, 2)],
                                              mode="functions")["sm_90"]
    decoding = {name: called for name, called in functions.items() if _constexprs(called, "group_words")}
    assert {name.split("/")[1].split("#")[0] for name in decoding} == {"moe_gate_up_kernel", "moe_down_kernel",
                                                                       "dequantize_kernel"}
    for name, called in decoding.items():
        assert _constexprs(called, "group_words") == {4, 6}, name
        assert _constexprs(called, "_codebook") == {1, 2}, name


def test_a_mixed_tables_rate_branches_hold_the_states_alone() -> None:
    """In every decoding variant of the K = 2 / K = 3 layer, the codebook walk (`_codebook_value`, whose own
    branches per codebook it calls itself) is called by `decode_block` alone, once per call of it, never from inside
    a rate's branch; each rate's states (`_rate_states`) are one call site per decode_block."""
    provider = f"{Path(__file__).with_name('mixed_rate_variants.py')}:mixed_layer_variants"
    graphs = static_kernels.compile_report(provider, [LayerShape("mixed-2-3", 256, 256, 4, 2)], mode="calls")["sm_90"]
    decoding = set()
    for name, graph in graphs.items():
        blocks = [function for function in graph if ".triton_decode.decode_block__" in function]
        if not blocks:
            continue
        decoding.add(name.split("/")[1].split("#")[0])
        codebook_callers = [caller for caller, callees in graph.items() for callee in callees
                            if "._codebook_value__" in callee and "._codebook_value__" not in caller]
        assert sorted(codebook_callers) == sorted(blocks), name
        rate_sites = Counter(_constexprs([callee], "_rate_states").pop() for callees in graph.values()
                             for callee in callees if "._rate_states__" in callee)
        assert rate_sites == {4: len(blocks), 6: len(blocks)}, name
    assert decoding == {"moe_gate_up_kernel", "moe_down_kernel", "dequantize_kernel"}


def test_the_kernels_walk_of_a_key_is_its_values() -> None:
    """The decode's compile-time walk over a key (first_present, then other_present until -1) meets exactly the
    values present_key was given, for every set of up to three rates and for single values (0 too)."""
    def walk(key: int) -> tuple[int, ...]:
        seen = []
        while key != -1:
            seen.append(triton_decode.first_present(key))
            key = triton_decode.other_present(key)
        return tuple(seen)

    for count in (1, 2, 3):
        for rates in itertools.combinations(_RATES, count):
            assert walk(present_key(rates)) == rates == present_values(present_key(rates))
    assert walk(present_key((0,))) == (0,) and walk(present_key((0, 1, 2))) == (0, 1, 2)
