"""Building the compiled CPU extension at first use (kernels/cpu_extension.py): one build per content key shared
by every install with the same sources, one builder among concurrent processes, a missing compiler, ninja or
header named before anything is compiled, and a failed build never taken for a finished one. The builder and the
library import are replaced here (the real build is test_cpu_isa's and the packaging test's)."""

from __future__ import annotations

import logging
import re
import sysconfig
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest

from vllm_expert_offload.kernels import cpu_exl3, cpu_extension
from vllm_expert_offload.kernels.cpu_extension import CpuKernelUnavailable, Extension, build_directory, load_extension


def _extension(directory: Path, **texts: str) -> Extension:
    """An extension over `main.cpp` and `body.inc` in `directory`, written with `texts`."""
    directory.mkdir(parents=True, exist_ok=True)
    contents = {"main.cpp": "#include \"body.inc\"\n", "body.inc": "int f() { return 1; }\n"} | texts
    for name, text in contents.items():
        (directory / name).write_text(text)
    return Extension("fake_ext", (directory / "main.cpp", directory / "body.inc"), ("-O3",), ())


@pytest.fixture
def tools_present(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """PATH holding only stub `c++` and `ninja` executables, so the preflight passes on any machine."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("c++", "ninja"):
        (bin_dir / name).write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("CXX", raising=False)
    if not (Path(sysconfig.get_path("include", scheme="posix_prefix")) / "Python.h").is_file():
        pytest.skip("this Python has no headers; test_missing_tools_are_each_named covers that case")
    return bin_dir


class _Builds:
    """A fake builder: counts calls, takes `seconds`, writes the library file and returns a stand-in module."""

    def __init__(self, seconds: float = 0.0, error: Exception | None = None) -> None:
        self.calls: list[Path] = []
        self.seconds, self.error = seconds, error
        self.lock = threading.Lock()

    def __call__(self, extension: Extension, main: Path, directory: Path) -> ModuleType:
        with self.lock:
            self.calls.append(directory)
        assert main == directory / "src" / "main.cpp" and (directory / "src" / "body.inc").is_file()
        # torch's loader would wait forever for a stale lock file of its own
        assert not (directory / cpu_extension.TORCH_BATON).exists()
        time.sleep(self.seconds)
        if self.error is not None:
            raise self.error
        (directory / f"{extension.name}.so").write_bytes(b"library")
        return ModuleType("built here")


@pytest.fixture
def imports(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Library loads of finished builds, recorded instead of dlopen-ing the fake library."""
    loaded: list[Path] = []

    def fake_import(name: str, directory: Path) -> ModuleType:
        assert (directory / f"{name}.so").read_bytes() == b"library"
        loaded.append(directory)
        return ModuleType("loaded")

    monkeypatch.setattr(cpu_extension, "_import", fake_import)
    return loaded


def test_same_bytes_anywhere_share_a_build_and_any_change_gets_its_own(tmp_path: Path) -> None:
    checkout = build_directory(_extension(tmp_path / "checkout"), tmp_path / "cache")
    installed = build_directory(_extension(tmp_path / "site-packages" / "csrc"), tmp_path / "cache")
    assert installed == checkout and checkout.parent == tmp_path / "cache"
    edited = build_directory(_extension(tmp_path / "edited", **{"body.inc": "int f() { return 2; }\n"}),
                             tmp_path / "cache")
    flags = Extension("fake_ext", _extension(tmp_path / "flags").sources, ("-O2",), ())
    assert len({checkout, edited, build_directory(flags, tmp_path / "cache")}) == 3


def test_concurrent_loads_build_once_and_the_rest_load_that_build(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tools_present: Path, imports: list[Path]
) -> None:
    extension = _extension(tmp_path / "src")
    directory = build_directory(extension, tmp_path / "cache")
    directory.mkdir(parents=True)
    (directory / cpu_extension.TORCH_BATON).write_text("")  # left by a killed build
    builder = _Builds(seconds=0.5)
    results: list[ModuleType] = []
    threads = [threading.Thread(target=lambda: results.append(load_extension(extension, tmp_path / "cache", builder)))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert builder.calls == [directory]  # one build; flock also excludes other descriptors of this process
    assert sorted(module.__name__ for module in results) == ["built here", "loaded", "loaded", "loaded"]
    assert imports == [directory] * 3 and (directory / cpu_extension.COMPLETE_FILE).is_file()
    # A later process finds the finished build and loads it without building (or needing a compiler).
    monkeypatch.setenv("PATH", "")
    assert load_extension(extension, tmp_path / "cache", builder).__name__ == "loaded" and len(builder.calls) == 1


def test_a_failed_build_is_reported_and_retried_next_time(
    tmp_path: Path, tools_present: Path, imports: list[Path]
) -> None:
    extension = _extension(tmp_path / "src")
    failing = _Builds(error=RuntimeError("Error building extension 'fake_ext': body.inc:1: error"))
    with pytest.raises(CpuKernelUnavailable, match=r"building main.cpp in .*fake_ext-\w+ failed: RuntimeError: Error"):
        load_extension(extension, tmp_path / "cache", failing)
    assert not (build_directory(extension, tmp_path / "cache") / cpu_extension.COMPLETE_FILE).exists()
    fixed = _Builds()
    assert load_extension(extension, tmp_path / "cache", fixed).__name__ == "built here" and len(fixed.calls) == 1


def test_missing_tools_are_each_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tools_present: Path) -> None:
    assert cpu_extension.missing_build_tools() == []
    (tools_present / "ninja").unlink()
    monkeypatch.setenv("CXX", "no-such-g++")
    monkeypatch.setattr(sysconfig, "get_path", lambda name, scheme=None: str(tmp_path / "no-include"))
    missing = cpu_extension.missing_build_tools()
    assert len(missing) == 3
    assert missing[0].startswith("a C++ compiler ('no-such-g++' is not on PATH; install g++")
    assert missing[1].startswith("ninja (not on PATH; ")
    assert missing[2].startswith(f"the Python headers ({tmp_path / 'no-include' / 'Python.h'} does not exist")
    # Refused with all of them before the builder runs.
    builder = _Builds()
    with pytest.raises(CpuKernelUnavailable, match=r"cannot build main.cpp: missing a C\+\+ compiler .*; ninja .*; the "
                                                   r"Python headers"):
        load_extension(_extension(tmp_path / "src"), tmp_path / "cache", builder)
    assert builder.calls == []


def test_missing_sources_are_named(tmp_path: Path) -> None:
    extension = _extension(tmp_path / "src")
    extension.sources[1].unlink()
    with pytest.raises(CpuKernelUnavailable, match=r"its C\+\+ sources \[.*body.inc'\] are missing from this "
                                                   r"installation .*reinstall"):
        load_extension(extension, tmp_path / "cache", _Builds())


def test_unwritable_cache_names_the_directory_and_the_variable(tmp_path: Path, tools_present: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the cache directory would go
    with pytest.raises(CpuKernelUnavailable, match=r"cannot write its build directory .*TORCH_EXTENSIONS_DIR"):
        load_extension(_extension(tmp_path / "src"), blocked, _Builds())


def test_kernel_is_attempted_once_per_process_and_its_absence_warned(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    attempts: list[Extension] = []

    def unavailable(extension: Extension) -> ModuleType:
        attempts.append(extension)
        raise CpuKernelUnavailable("cannot build exl3_cpu.cpp: missing ninja (not on PATH; `pip install ninja`)")

    monkeypatch.setattr(cpu_exl3, "load_extension", unavailable)
    cpu_exl3._load_once.cache_clear()
    # Attached to the logger itself: once vLLM is imported its "vllm" logger stops propagating to caplog's root.
    monkeypatch.setattr(cpu_exl3.logger, "propagate", False)
    cpu_exl3.logger.addHandler(caplog.handler)
    try:
        for _ in range(3):
            assert cpu_exl3.cpu_kernel_unavailable() == ("cannot build exl3_cpu.cpp: missing ninja (not on PATH; "
                                                         "`pip install ninja`)")
        with pytest.raises(CpuKernelUnavailable, match="missing ninja"):
            cpu_exl3.extension()
    finally:
        cpu_exl3.logger.removeHandler(caplog.handler)
        cpu_exl3._load_once.cache_clear()  # the real extension loads again for later tests
    assert attempts == [cpu_exl3.EXTENSION]
    warnings = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]
    assert warnings == ["the compiled EXL3 CPU kernels are unavailable: cannot build exl3_cpu.cpp: missing ninja "
                        "(not on PATH; `pip install ninja`)"]


def test_the_kernel_sources_are_inside_the_package() -> None:
    package = Path(cpu_exl3.__file__).resolve().parents[1]
    sources = cpu_exl3.EXTENSION.sources
    assert {path.parent for path in sources} == {package / "csrc"}
    assert all(path.is_file() for path in sources)
    # Every file the translation unit includes is a source (a change to it must change the build's digest).
    included = set(re.findall(r'#include "([^"]+)"', sources[0].read_text()))
    assert included == {path.name for path in sources[1:]}
