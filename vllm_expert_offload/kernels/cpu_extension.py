"""Building and loading a torch C++ extension from the package's own sources (vllm_expert_offload/csrc/), once
per machine, at first use.

Why at first use rather than when the wheel is built: the library links against libtorch, and this plugin is
installed next to a vLLM that brings its own torch (the CPU build, a CUDA build, versions the wheel's builder
never saw). A prebuilt library would be tied to one torch ABI, and an sdist compiled by pip in an isolated build
environment would compile against whatever torch pip fetched there, not the one that imports it. So the sources
ship as package data and are compiled against the torch that is running.

The build goes to a directory of torch's extension cache (TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions)
named by a digest of the sources' names and bytes, the flags, torch's build and Python's ABI: an editable checkout
and an installed wheel with the same sources share one build, a changed source or torch gets a fresh directory,
and a finished build is loaded without a compiler. One process builds, holding an flock on the directory (the
kernel releases it if that process dies); the others wait for it and load its result. When it cannot build, the
error names what is missing (compiler, ninja, headers) before anything is compiled.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from ..errors import ExpertOffloadError

logger = logging.getLogger("vllm.expert_offload")

LOCK_FILE = "build.lock"
COMPLETE_FILE = "complete"  # written once the library has loaded: its presence means the directory is whole
TORCH_BATON = "lock"  # torch's own build lock (a plain file), left behind forever when a build is killed


class CpuKernelUnavailable(ExpertOffloadError, RuntimeError):
    """The compiled CPU extension cannot be built or loaded here; the message says what is missing."""


@dataclass(frozen=True)
class Extension:
    """A torch C++ extension: `sources[0]` is compiled, the other sources are files it includes."""

    name: str
    sources: tuple[Path, ...]
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]


Builder = Callable[[Extension, Path, Path], ModuleType]  # (extension, main source, directory) -> imported module


def extensions_root() -> Path:
    """Torch's extension cache: TORCH_EXTENSIONS_DIR, else its per-user default."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def build_key(extension: Extension, sources: dict[str, bytes]) -> str:
    """Digest of everything the built library depends on, so equal inputs anywhere share one build."""
    inputs = {"name": extension.name, "cflags": extension.cflags, "ldflags": extension.ldflags,
              "torch": [torch.__version__, torch.version.git_version], "python": sys.implementation.cache_tag,
              "abiflags": getattr(sys, "abiflags", ""), "machine": platform.machine()}
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode())
    for name, text in sources.items():
        digest.update(hashlib.sha256(name.encode()).digest() + hashlib.sha256(text).digest())
    return digest.hexdigest()[:16]


def build_directory(extension: Extension, root: Path | None = None) -> Path:
    """Where `extension` is (or would be) built from its sources as they are now."""
    return _directory(extension, _read_sources(extension), root)


def _directory(extension: Extension, sources: dict[str, bytes], root: Path | None) -> Path:
    return (root or extensions_root()) / f"{extension.name}-{build_key(extension, sources)}"


def missing_build_tools() -> list[str]:
    """What a build would lack here, each with how to get it; empty when compiler, ninja and headers are present."""
    from torch.utils.cpp_extension import get_cxx_compiler, include_paths

    missing = []
    compiler = get_cxx_compiler()
    if shutil.which(compiler.split()[0]) is None:
        missing.append(f"a C++ compiler ({compiler!r} is not on PATH; install g++, e.g. `apt-get install g++`, "
                       f"or set CXX)")
    if shutil.which("ninja") is None:
        beside = Path(sys.executable).parent / "ninja"
        hint = f"{beside} exists but its directory is not on PATH" if beside.is_file() else "`pip install ninja`"
        missing.append(f"ninja (not on PATH; {hint})")
    python_header = Path(sysconfig.get_path("include", scheme="posix_prefix")) / "Python.h"
    if not python_header.is_file():
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        missing.append(f"the Python headers ({python_header} does not exist; e.g. "
                       f"`apt-get install python{version}-dev`)")
    torch_header = Path(include_paths()[0]) / "torch" / "extension.h"
    if not torch_header.is_file():
        missing.append(f"torch's C++ headers ({torch_header} does not exist)")
    return missing


def load_extension(extension: Extension, root: Path | None = None, builder: Builder | None = None) -> ModuleType:
    """The extension module, built first unless a finished build of these exact sources exists; else
    CpuKernelUnavailable saying why. `builder` compiles and imports (tests replace it); by default torch's
    C++ extension loader."""
    sources = _read_sources(extension)
    directory = _directory(extension, sources, root)
    if not (directory / COMPLETE_FILE).is_file():
        built = _build_once(extension, sources, directory, builder or _torch_build)
        if built is not None:
            return built
    return _import(extension.name, directory)


def _read_sources(extension: Extension) -> dict[str, bytes]:
    missing = [str(path) for path in extension.sources if not path.is_file()]
    if missing:
        raise CpuKernelUnavailable(f"its C++ sources {missing} are missing from this installation (they ship as "
                                   f"package data of vllm-expert-offload: reinstall it)")
    return {path.name: path.read_bytes() for path in extension.sources}


def _build_once(extension: Extension, sources: dict[str, bytes], directory: Path, builder: Builder
                ) -> ModuleType | None:
    """Builds under the directory's lock and returns the module, or None when another process finished the
    build while this one waited for the lock."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(directory / LOCK_FILE, "a")  # noqa: SIM115 (closed below; closing releases the flock)
    except OSError as exc:
        raise CpuKernelUnavailable(f"cannot write its build directory {directory} ({exc}); set "
                                   f"TORCH_EXTENSIONS_DIR to a writable directory") from exc
    with lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process building %s in %s", extension.name, directory)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if (directory / COMPLETE_FILE).is_file():
            return None
        main = extension.sources[0].name
        missing = missing_build_tools()
        if missing:
            raise CpuKernelUnavailable(f"cannot build {main}: missing {'; '.join(missing)}")
        # Only a dead build can have left torch's baton here, since a live one holds our lock; torch would wait
        # for that file to vanish forever.
        (directory / TORCH_BATON).unlink(missing_ok=True)
        source_dir = directory / "src"
        source_dir.mkdir(exist_ok=True)
        for name, text in sources.items():
            (source_dir / name).write_bytes(text)  # the bytes the key names, whatever the installed files do next
        logger.info("building %s from %s into %s (once per machine, torch and source version; a minute or two)",
                    main, extension.sources[0].parent, directory)
        try:
            module = builder(extension, source_dir / main, directory)
        except Exception as exc:  # a compiler error, an OpenMP-less compiler, a failed import: all mean "not here"
            raise CpuKernelUnavailable(f"building {main} in {directory} failed: {type(exc).__name__}: {exc}") from exc
        (directory / COMPLETE_FILE).write_text(f"{main} built for torch {torch.__version__}\n")
        return module


def _torch_build(extension: Extension, main: Path, directory: Path) -> ModuleType:
    from torch.utils.cpp_extension import load

    return load(name=extension.name, sources=[str(main)], extra_cflags=list(extension.cflags),
                extra_ldflags=list(extension.ldflags), build_directory=str(directory), verbose=False)


def _import(name: str, directory: Path) -> ModuleType:
    library = directory / f"{name}.so"
    spec = importlib.util.spec_from_file_location(name, library)
    try:
        if spec is None or spec.loader is None or not library.is_file():
            raise ImportError(f"{library} does not exist")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise CpuKernelUnavailable(f"loading {library} failed ({exc}); delete {directory} to rebuild it") from exc
    return module
