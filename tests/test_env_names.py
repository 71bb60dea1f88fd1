"""Every environment variable the package reads is its own, under one prefix (VLLM_EXPERT_OFFLOAD_*), or one another
program owns (Triton, torch, CUDA, vLLM), listed here by name. Read from the sources: `os.environ.get(NAME)`,
`environ.get(NAME)`, `os.getenv(NAME)` with NAME a string or a module constant holding one."""

from __future__ import annotations

import ast
from pathlib import Path

import vllm_expert_offload

PACKAGE = Path(vllm_expert_offload.__file__).parent
PREFIX = "VLLM_EXPERT_OFFLOAD_"
FOREIGN = {"TRITON_INTERPRET", "TORCH_EXTENSIONS_DIR", "CUDA_VISIBLE_DEVICES", "VLLM_CPU_OMP_THREADS_BIND"}


def _read_names(source: str) -> set[str]:
    tree = ast.parse(source)
    constants = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for target in node.targets if isinstance(target, ast.Name)}
    names = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
            continue
        receiver = ast.unparse(node.func.value)
        if (node.func.attr == "get" and receiver.split(".")[-1] == "environ") or ast.unparse(node.func) == "os.getenv":
            key = node.args[0]
            if isinstance(key, ast.Constant):
                names.add(key.value)
            elif isinstance(key, ast.Name):
                names.add(constants.get(key.id, f"<{key.id}: not a module constant>"))
    return names


def test_every_variable_read_is_under_the_prefix_or_another_programs() -> None:
    read = {name for path in PACKAGE.rglob("*.py") if path.relative_to(PACKAGE).parts[0] != "testing"
            for name in _read_names(path.read_text())}
    assert {"VLLM_EXPERT_OFFLOAD_KV_FIX", "VLLM_EXPERT_OFFLOAD_TRITON_REGISTER_DECODE", "TRITON_INTERPRET"} <= read
    assert sorted(name for name in read if not name.startswith(PREFIX) and name not in FOREIGN) == []


def test_the_scan_sees_a_stray_name() -> None:
    source = 'import os\nENV = "VEO_X"\nos.environ.get(ENV)\nos.getenv("OTHER")\n'
    assert _read_names(source) == {"VEO_X", "OTHER"}
