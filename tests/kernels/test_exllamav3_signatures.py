"""Our exllamav3 calls against the argument lists in exllamav3 1.6.5's C++ headers, on the CPU: a signature change
between releases fails here instead of in a server. Every call site passes its arguments by these names through
`call_ext`, which orders them by SIGNATURES; test_exllamav3_backend.py runs those call sites against a fake
extension whose functions take the headers' argument lists."""

from __future__ import annotations

import re

import pytest

from vllm_expert_offload.kernels.exllamav3_backend import SIGNATURES

from support.exllamav3_headers import EXT, HEADERS, declaration, header_signature, header_text


def mismatches(name: str, header: list[tuple[str, str]]) -> list[str]:
    """What differs between our SIGNATURES[name] and a header's argument list (empty when they agree)."""
    ours = list(SIGNATURES[name])
    problems = [] if len(ours) == len(header) else [f"{len(ours)} arguments, the header has {len(header)}"]
    problems += [f"argument {i}: ours {mine}, header {theirs}"
                 for i, (mine, theirs) in enumerate(zip(ours, header)) if mine != theirs]
    return problems


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_our_calls_match_the_headers(name: str) -> None:
    assert mismatches(name, header_signature(name)) == []


def test_every_function_we_call_is_bound_under_its_name() -> None:
    bindings = (EXT / "bindings.cpp").read_text()
    assert sorted(SIGNATURES) == sorted(HEADERS)
    for name in SIGNATURES:
        assert re.search(rf'm\.def\("{name}",\s*&{name}\b', bindings), f"bindings.cpp does not expose {name}"


def _drop(text: str) -> str:
    return text.replace("    const int m_tile\n", "").replace("const int count_hi,", "const int count_hi")


def _swap(text: str) -> str:
    return text.replace("const float K_gate,\n    const float K_up,", "const float K_up,\n    const float K_gate,")


def _retype(text: str) -> str:
    return text.replace("const int num_active,", "const float num_active,")


def _rename(text: str) -> str:
    return text.replace("const at::Tensor& weight_sorted,\n\n", "const at::Tensor& weights_sorted,\n\n")


@pytest.mark.parametrize("change", [_drop, _swap, _retype, _rename])
def test_a_changed_signature_fails_the_check(change) -> None:
    """Negative control: exl3_moe's real header, changed as a release might change it."""
    text = header_text("exl3_moe")
    changed = change(text)
    assert changed != text, "the edit no longer applies to the header"
    assert mismatches("exl3_moe", declaration(changed, "exl3_moe")) != []


def test_the_parser_reads_defaults_optionals_and_one_line_declarations() -> None:
    text = ("int f(int device);\n"
            "void g\n(\n    const c10::optional<at::Tensor>& a = {},  // note\n    bool b = false\n);")
    assert declaration(text, "f") == [("device", "int")]
    assert declaration(text, "g") == [("a", "optional tensor"), ("b", "bool")]
