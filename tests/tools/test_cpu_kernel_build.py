"""tools/cpu_kernel_build.py, which scripts/gpu-check.sh runs first, in the background, so that the GPU tests of the CPU
tier load the extension instead of compiling it at first use: what it built where and in how long, a finished build
found, and a refusal naming what is missing; the compile itself replaced (tests/kernels build the real one)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from vllm_expert_offload.kernels import cpu_extension
from vllm_expert_offload.kernels.cpu_exl3 import EXTENSION
from vllm_expert_offload.tools.cpu_kernel_build import main


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    return cpu_extension.build_directory(EXTENSION, tmp_path)


def test_it_builds_into_the_extension_cache_and_says_where_and_how_long(
        cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    built = []
    monkeypatch.setattr(cpu_extension, "missing_build_tools", lambda: [])
    monkeypatch.setattr(cpu_extension, "_torch_build", lambda ext, main_source, directory: built.append(
        (main_source.name, directory)) or types.ModuleType(ext.name))
    assert main([]) == 0
    assert built == [("exl3_cpu.cpp", cache)] and (cache / cpu_extension.COMPLETE_FILE).is_file()
    out = capsys.readouterr().out
    assert f"building {EXTENSION.sources[0]} into {cache}" in out
    assert f"built in {cache} in " in out and out.rstrip().endswith(" s")
    assert main([]) == 0 and f"already built in {cache}" in capsys.readouterr().out and len(built) == 1


@pytest.mark.parametrize("args", [[], ["--check"]])
def test_without_a_compiler_it_refuses_saying_so_before_compiling(
        cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, args: list[str]) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    monkeypatch.setattr(cpu_extension, "_torch_build", lambda *a: pytest.fail("compiled without a compiler"))
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "a C++ compiler ('/nonexistent/c++' is not on PATH" in err and "exl3_cpu.cpp" in err
    assert not (cache / cpu_extension.COMPLETE_FILE).exists()


def test_check_builds_nothing_and_says_where_it_would(
        cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(cpu_extension, "missing_build_tools", lambda: [])
    monkeypatch.setattr(cpu_extension, "_torch_build", lambda *a: pytest.fail("--check compiled"))
    assert main(["--check"]) == 0
    assert f"would build {EXTENSION.sources[0]} into {cache} (--check: nothing built)" in capsys.readouterr().out
    assert not cache.exists()
