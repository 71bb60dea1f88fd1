"""The package's data flow, checked on its import statements: checkpoint -> exl3 -> placement -> offload ->
kernels -> integration (docs/architecture.md). No module imports from a layer after its own, only integration/
(and the commands and test helpers above it) imports vLLM, and every module under integration/ does."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import vllm_expert_offload

PACKAGE = Path(vllm_expert_offload.__file__).parent
LEAVES = {"errors", "units", "validation"}  # importing nothing of the package: usable from every layer
# What each layer may import from the package (besides the leaves and itself), and whether it may import vLLM.
ALLOWED: dict[str, tuple[set[str], bool]] = {
    "exl3": (set(), False),
    "placement": ({"exl3"}, False),
    "memory": (set(), False),
    "offload": ({"exl3", "placement", "memory"}, False),
    "kv": (set(), False),
    "kernels": ({"exl3", "placement", "memory", "offload"}, False),
    "integration": ({"exl3", "placement", "memory", "offload", "kv", "kernels"}, True),
    "tools": ({"exl3", "placement", "memory", "offload", "kv", "kernels", "integration"}, True),
    "testing": ({"exl3", "placement", "memory", "offload", "kv", "kernels", "integration", "tools"}, True),
}


def _modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if "sitecustomize" not in p.parts[-2]]


def _imports(path: Path) -> set[str]:
    """Absolute dotted names of everything `path` imports (relative imports resolved)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            module = ".".join(filter(None, (base, node.module)))
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def _layer(dotted: str) -> str | None:
    """The package folder or leaf module `dotted` lies in; None outside the package or for the root itself."""
    parts = dotted.split(".")
    if parts[0] != "vllm_expert_offload" or len(parts) == 1:
        return None
    inside = PACKAGE / parts[1]
    return parts[1] if inside.is_dir() or inside.with_suffix(".py").is_file() else None


def _violations(path: Path) -> list[str]:
    layer = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
    if layer not in ALLOWED:
        return []
    allowed, vllm_ok = ALLOWED[layer]
    found = []
    for name in sorted(_imports(path)):
        target = _layer(name)
        if target is not None and target not in allowed | LEAVES | {layer, None} and name != "vllm_expert_offload":
            found.append(f"{path.relative_to(PACKAGE)} imports {name} (layer {target!r} is above {layer!r})")
        if not vllm_ok and (name == "vllm" or name.startswith("vllm.")):
            found.append(f"{path.relative_to(PACKAGE)} imports {name} (layer {layer!r} must not import vLLM)")
    return found


def test_no_module_imports_from_a_later_layer_or_vllm_below_integration() -> None:
    assert [v for path in _modules() for v in _violations(path)] == []


def test_leaves_import_nothing_of_the_package() -> None:
    for leaf in LEAVES:
        names = _imports(PACKAGE / f"{leaf}.py")
        assert {n for n in names if _layer(n) not in (None, *LEAVES)} == set(), leaf


def _names_vllm_module(path: Path) -> bool:
    """A string constant naming a vLLM module: the target of a version-checked hook (patching.Hook)."""
    return any(isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("vllm.")
               for node in ast.walk(ast.parse(path.read_text())))


def _serves_a_hook(path: Path) -> bool:
    """A module whose wrappers integration/vllm_hooks.py installs (imported there by name)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return module in _imports(PACKAGE / "integration" / "vllm_hooks.py")


@pytest.mark.parametrize("path", [p for p in _modules() if p.relative_to(PACKAGE).parts[0] == "integration"
                                  and p.name != "__init__.py"], ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_integration_module_imports_or_hooks_vllm(path: Path) -> None:
    """integration/ holds only what touches vLLM: it imports vLLM, names the vLLM module it hooks, or holds the
    wrappers vllm_hooks.py declares."""
    assert (any(name == "vllm" or name.startswith("vllm.") for name in _imports(path)) or _names_vllm_module(path)
            or _serves_a_hook(path))


def test_the_check_itself_sees_a_violation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a format module importing a kernel, and one importing vLLM, are both reported."""
    fake = tmp_path / "vllm_expert_offload"
    (fake / "exl3").mkdir(parents=True)
    (fake / "kernels").mkdir()
    (fake / "exl3" / "bad.py").write_text("from ..kernels import ops\nimport vllm.config\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    found = _violations(fake / "exl3" / "bad.py")
    assert any("kernels" in v for v in found) and any("must not import vLLM" in v for v in found)
