"""The plugin's contact surface with vLLM is one module (integration/vllm_hooks.py): it lists every patch with its
target, kind and the vLLM versions checked; each declared target exists here with the parameters declared; no other
module declares a hook or assigns to a vLLM attribute (read from the sources); and installing everything changes
exactly the declared targets of vLLM's modules and classes, nothing else (a snapshot, in a fresh process)."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

import vllm_expert_offload
from vllm_expert_offload.integration import vllm_hooks
from vllm_expert_offload.integration.patching import Addition, ClassHook, Hook, InstancePatch
from vllm_expert_offload.integration.versions import VERIFIED_VLLM

PACKAGE = Path(vllm_expert_offload.__file__).parent
HOOKS_MODULE = PACKAGE / "integration" / "vllm_hooks.py"
DECLARATIONS = ("Hook", "ClassHook", "InstancePatch", "Addition")
PATCHING_MODULE = PACKAGE / "integration" / "patching.py"  # the mechanism: ClassHook.for_class builds its Hook
# setattr/delattr calls allowed outside vllm_hooks.py, each on an object that is no vLLM module or class.
SETATTR_ALLOWED = {
    "integration/patching.py",  # the mechanism: applies what vllm_hooks.py declares
    "integration/methods/collectors.py",  # a layer instance's loader store
}


def _declared() -> list[Hook | ClassHook | InstancePatch | Addition]:
    found = []
    for value in vars(vllm_hooks).values():
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, (Hook, ClassHook, InstancePatch, Addition)):
                found.append(item)
    return found


def test_the_surface_lists_every_declared_patch_with_kind_and_versions(capsys) -> None:
    rows = vllm_hooks.surface()
    for row in rows:
        print(f"{row.kind:15} {row.target}  [vLLM {', '.join(row.versions)}]  {row.when}")
    declared = _declared()
    assert {item.target for item in declared} <= {row.target for row in rows}
    assert len({row.target for row in rows}) == len(rows) == len(declared) + 1  # + the quantization registry
    assert all(row.versions == VERIFIED_VLLM and row.kind for row in rows)
    assert "vllm.v1.worker.gpu_model_runner.GPUModelRunner.profile_run" in capsys.readouterr().out


def test_the_architecture_page_tables_every_contact() -> None:
    """docs/architecture.md's contact-surface table names each target's module and attribute, and its kind."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    table = page.split("## The contact surface with vLLM", 1)[1].split("\n## ", 1)[0]
    for row in vllm_hooks.surface():
        parts = row.target.split(".")
        module = ".".join(parts[:next((i for i, p in enumerate(parts) if p[:1].isupper()), len(parts) - 1)])
        assert parts[-1] in table and (module in table or row.target.startswith("<")), row.target
        assert f"| {row.kind} |" in table or f"| {row.kind} (" in table, row.kind


@pytest.mark.parametrize("hook", [h for h in _declared() if isinstance(h, (Hook, InstancePatch))],
                         ids=lambda h: h.target)
def test_each_declared_target_exists_with_the_declared_parameters(hook: Hook | InstancePatch) -> None:
    owner = importlib.import_module(hook.module)
    for part in hook.name.split("."):
        owner = inspect.getattr_static(owner, part)
    function = inspect.unwrap(getattr(owner, "__func__", owner))
    assert tuple(inspect.signature(function).parameters) == hook.params


def _root(node: ast.AST) -> ast.AST:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node


def _vllm_code(tree: ast.AST) -> set[str]:
    """Names bound to vLLM's modules and classes: imported from vLLM, or aliases of those (`platform =
    type(current_platform)`, `runner = gpu_model_runner.GPUModelRunner`)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            names |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "vllm"}
    grown = True
    while grown:
        aliases = set()
        for node in ast.walk(tree):
            if not isinstance(node, ast.Assign):
                continue
            value = node.value
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "type":
                value = value.args[0] if value.args else value
            root = _root(value)
            if isinstance(root, ast.Name) and root.id in names:
                aliases |= {target.id for target in node.targets if isinstance(target, ast.Name)}
        grown = not aliases <= names
        names |= aliases
    return names


def _vllm_objects(tree: ast.AST, code: set[str]) -> set[str]:
    """Parameters annotated with a vLLM class: objects vLLM hands the plugin (an engine client, a worker)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            annotation = node.annotation
            if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
                annotation = ast.parse(annotation.value, mode="eval").body
            if any(isinstance(n, ast.Name) and n.id in code for n in ast.walk(annotation)):
                names.add(node.arg)
    return names


def _patches_outside_the_surface(path: Path) -> list[str]:
    """Hook declarations, setattr/delattr calls, assignments (or deletions) to attributes of vLLM's modules and
    classes at any depth, and to a vLLM object's own attributes (its methods shadowed); a field of an object's
    field (`config.cache_config.block_size`, a config the plugin builds) is data, not a patch."""
    relative = str(path.relative_to(PACKAGE))
    tree = ast.parse(path.read_text())
    code = _vllm_code(tree)
    objects = _vllm_objects(tree, code)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in DECLARATIONS and path not in (HOOKS_MODULE, PATCHING_MODULE):
                found.append(f"{relative}:{node.lineno} declares a {node.func.id}")
            if node.func.id in ("setattr", "delattr") and relative not in SETATTR_ALLOWED:
                found.append(f"{relative}:{node.lineno} calls {node.func.id}")
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            if not isinstance(target, ast.Attribute) or not isinstance(_root(target), ast.Name):
                continue
            if _root(target).id in code or (isinstance(target.value, ast.Name) and target.value.id in objects):
                found.append(f"{relative}:{node.lineno} assigns to {ast.unparse(target)}")
    return found


def test_no_other_module_patches_vllm() -> None:
    """testing/ holds the CPU test shims (never imported by shipped code: test_layering), which patch on purpose."""
    modules = [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] != "testing"]
    assert [f for path in modules for f in _patches_outside_the_surface(path)] == []


def test_the_source_check_sees_a_patch(tmp_path: Path) -> None:
    """Negative control: a module assigning to a vLLM class, and one declaring a hook of its own, are reported."""
    fake = PACKAGE / "integration" / "startup" / "_probe.py"
    for source, what in (("from vllm.v1.worker.gpu_worker import Worker\nWorker.run = None\n", "assigns to Worker.run"),
                         ("import vllm.v1.worker\nvllm.v1.worker.x = 1\n", "assigns to vllm.v1.worker.x"),
                         ("from vllm.engine.protocol import EngineClient\n"
                          "def f(client: EngineClient):\n    del client.shutdown\n", "assigns to client.shutdown"),
                         ("def f():\n    from vllm.platforms import current_platform\n"
                          "    platform = type(current_platform)\n    platform.x = 1\n", "assigns to platform.x"),
                         ("from vllm.config import VllmConfig\ndef f(config: VllmConfig):\n"
                          "    config.compile = None\n", "assigns to config.compile"),
                         ("Hook('vllm.x', 'f', (), None)\n", "declares a Hook"),
                         ("setattr(object, 'x', 1)\n", "calls setattr")):
        fake.write_text(source)
        try:
            assert any(what in f for f in _patches_outside_the_surface(fake)), source
        finally:
            fake.unlink()


SNAPSHOT = r"""
import importlib, json, sys
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)

def snapshot():
    state = {}
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] != "vllm" or module is None:
            continue
        for attr, value in list(vars(module).items()):
            state[f"{name}.{attr}"] = (id(value), type(value).__name__ == "module")
            if isinstance(value, type) and value.__module__ == name:
                for cattr, cvalue in list(vars(value).items()):
                    state[f"{name}.{attr}.{cattr}"] = (id(cvalue), False)
    return state

before = snapshot()
from vllm_expert_offload.integration import vllm_hooks
from vllm_expert_offload.integration.plugin import register_plugin
register_plugin()
vllm_hooks.install_profile_flag()
vllm_hooks.install_crash_line(0.03, [1])
vllm_hooks.ENGRAM.install({})
vllm_hooks.install_replay_padding()
after = snapshot()
owners = {key.rpartition(".")[0] for key in before}
changed = [k for k, (ident, is_module) in after.items()
           if (k in before and before[k][0] != ident) or (k not in before and not is_module
                                                          and k.rpartition(".")[0] in owners)]
print("CHANGED " + json.dumps(sorted(changed)))
"""


def test_installing_everything_changes_exactly_the_declared_targets() -> None:
    """In a fresh process: every vLLM module the hooks name imported, every attribute of those modules and of the
    classes they define snapshotted, everything installed, the snapshot compared (modules vLLM imports meanwhile
    are new, not changed)."""
    modules = sorted({h.module for h in _declared() if isinstance(h, Hook)} | {"vllm.v1.worker.worker_base"})
    result = subprocess.run([sys.executable, "-c", SNAPSHOT, json.dumps(modules)], capture_output=True, text=True,
                            timeout=280, cwd=PACKAGE.parent)
    line = next((ln for ln in result.stdout.splitlines() if ln.startswith("CHANGED ")), None)
    assert line is not None, result.stderr[-3000:]
    changed = set(json.loads(line.removeprefix("CHANGED ")))
    installed = {h.target for h in _declared() if not isinstance(h, (ClassHook, InstancePatch))}
    assert changed == installed


def test_an_instance_patch_lasts_the_block_and_gives_back_what_the_object_had() -> None:
    """The platform class with a method of its own gets it back; an object without one loses the shadow; a
    class method read with other parameters is refused before anything is set."""
    from vllm.platforms.interface import DeviceCapability, Platform

    from vllm_expert_offload.integration.patching import HookError

    own = classmethod(lambda cls, device_id=0: "own")
    with_own = type("WithOwn", (Platform,), {"get_device_capability": own})
    without = type("Without", (Platform,), {})
    sm120 = DeviceCapability(12, 0)
    for platform in (with_own, without):
        with vllm_hooks.EMULATED_CAPABILITY.applied(platform, sm120):
            assert platform.get_device_capability() == sm120 and platform.get_device_capability(3) == sm120
        assert ("get_device_capability" in vars(platform)) is (platform is with_own)
    assert vars(with_own)["get_device_capability"] is own
    changed = InstancePatch("vllm.platforms.interface", "Platform.get_device_capability", ("cls",),
                            vllm_hooks.EMULATED_CAPABILITY.wrap)
    with pytest.raises(HookError, match=r"Platform.get_device_capability takes \('cls', 'device_id'\)"):
        with changed.applied(without, sm120):
            pass
    assert "get_device_capability" not in vars(without)
