"""Fixture cache keys (testing/tiny_models.py) hash every source that shapes a fixture, so a warm cache can never
serve bytes an encoder, decoder or kernel change would have made differently."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vllm_expert_offload.kernels import cpu_exl3
from vllm_expert_offload.testing import tiny_models
from vllm_expert_offload.testing.tiny_models import DECODE_CODE, ENCODE_CODE, fixture_sources

SPEC = {"arch": "qwen3_moe", "k": 3}
EXL3 = Path(tiny_models.__file__).resolve().parents[1] / "exl3"
# The format layer and the leaves (tests/test_layering.py): what a build runs, spelled out here rather than read from
# the module under test.
FORMAT_LAYER = ("vllm_expert_offload.exl3", "vllm_expert_offload.errors", "vllm_expert_offload.units",
                "vllm_expert_offload.validation")


def test_the_format_code_a_build_runs_is_hashed() -> None:
    names = {path.name for path in fixture_sources(()) if path.parent == EXL3}
    assert {"convert.py", "bitrate.py", "codebook.py", "tile.py", "ring.py", "hadamard.py", "tensors.py", "decode.py",
            "checkpoint.py", "deepseek_v4.py", "encode.py"} <= names
    assert Path(tiny_models.__file__).resolve() in fixture_sources(())
    dsv4 = Path(tiny_models.__file__).with_name("tiny_dsv4.py").resolve()
    assert dsv4 in fixture_sources(("vllm_expert_offload.testing.tiny_dsv4",)) and dsv4 not in fixture_sources(())


@pytest.mark.parametrize("code", [(), ENCODE_CODE, DECODE_CODE])
def test_every_format_module_a_build_imports_is_hashed(code) -> None:
    """Independent of the import reading: the modules Python actually loads for the build code, in a fresh process."""
    modules = ["vllm_expert_offload.testing.tiny_models", "vllm_expert_offload.exl3.convert", *code]
    script = (f"import sys\nfor m in {modules!r}: __import__(m)\n"
              f"print('\\n'.join(sorted(getattr(sys.modules[n], '__file__', '') for n in list(sys.modules) "
              f"if n.startswith({FORMAT_LAYER!r}))))")
    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=300)
    hashed = set(fixture_sources(code))
    assert {Path(line).resolve() for line in loaded.stdout.split()} - hashed == set()


def test_a_change_in_any_hashed_source_changes_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    base = tiny_models._cache_key(SPEC, ())
    for path in fixture_sources(()):
        monkeypatch.setattr(tiny_models, "_source_bytes",
                            lambda p, changed=path: p.read_bytes() + (b"#" if p == changed else b""))
        assert tiny_models._cache_key(SPEC, ()) != base, path
    monkeypatch.undo()
    monkeypatch.setattr(tiny_models.platform, "python_version", lambda: "3.99.0")
    assert tiny_models._cache_key(SPEC, ()) != base  # the tokenizer's corpus is the standard library's docstrings


def test_viterbi_fixtures_are_keyed_by_the_search_and_its_compiled_sources(tmp_path, monkeypatch) -> None:
    copies = []
    for source in cpu_exl3.kernel_sources():
        copies.append(tmp_path / source.name)
        copies[-1].write_bytes(source.read_bytes())
    monkeypatch.setattr(cpu_exl3, "kernel_sources", lambda: tuple(copies))
    monkeypatch.setattr(tiny_models, "compiled_viterbi", lambda: object())
    compiled, random = tiny_models._cache_key(SPEC, ENCODE_CODE), tiny_models._cache_key(SPEC, ())
    for copy in copies:
        original = copy.read_bytes()
        copy.write_bytes(original + b"\n")
        assert tiny_models._cache_key(SPEC, ENCODE_CODE) != compiled, copy.name
        assert tiny_models._cache_key(SPEC, ()) == random  # a random-trellis fixture never runs the search
        copy.write_bytes(original)
    monkeypatch.setattr(tiny_models, "compiled_viterbi", lambda: None)  # no compiler: the torch search runs
    assert tiny_models._cache_key(SPEC, ENCODE_CODE) != compiled
