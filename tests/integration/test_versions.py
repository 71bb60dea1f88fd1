"""The vLLM version gate (integration/versions.py) and the hooks' own checks (integration/patching.py).

A vLLM newer than the verified series starts, with a warning, and keeps working; an older one is refused with the
versions and the override named; every hook refuses a target whose signature is not the one it was written for,
also on a newer vLLM, whatever its kind (function, method, classmethod, staticmethod).
"""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Iterator

import pytest

from vllm_expert_offload.integration import versions
from vllm_expert_offload.integration.patching import SENTINEL, Hook, HookError

from support.paths import FIXTURES


@pytest.fixture
def warnings() -> Iterator[list[str]]:
    """Messages of the plugin's version logger ("vllm.expert_offload", which vLLM's config stops from propagating)."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler = Collect(logging.WARNING)
    versions.logger.addHandler(handler)
    try:
        yield lines
    finally:
        versions.logger.removeHandler(handler)


def test_verified_series_start_quietly(warnings: list[str]) -> None:
    assert versions.check_vllm_version("0.32.0") == "0.32"
    assert versions.check_vllm_version("0.33.1+cu130") == "0.33"
    assert warnings == []


def test_newer_vllm_starts_with_one_warning(monkeypatch: pytest.MonkeyPatch, warnings: list[str]) -> None:
    monkeypatch.setattr(versions, "_warned", set())
    for _ in range(2):
        assert versions.check_vllm_version("0.35.0.dev12+g1234abc") == "0.35"
    assert warnings == [
        "vllm-expert-offload was verified on vLLM 0.32, 0.33; starting on vLLM 0.35.0.dev12+g1234abc anyway. Each "
        "hook checks the function it patches and refuses if its signature changed; report anything else that breaks."
    ]
    assert versions.check_vllm_version("1.0.0") == "1.0"


@pytest.mark.parametrize("older", ["0.31.2", "0.1.dev20904+g179dd0fa9"])
def test_older_vllm_refused_unless_overridden(monkeypatch: pytest.MonkeyPatch, older: str) -> None:
    monkeypatch.delenv(versions.OVERRIDE_ENV, raising=False)
    with pytest.raises(versions.VLLMVersionError, match=rf"verified on vLLM 0\.32, 0\.33 and starts on newer ones; "
                                                        rf"this is the older vLLM {older.replace('+', '.')}.*"
                                                        rf"VLLM_EXPERT_OFFLOAD_ALLOW_UNVERIFIED_VLLM=1"):
        versions.check_vllm_version(older)
    with pytest.raises(HookError, match=r"^the crash-line hook: vllm-expert-offload was verified"):
        from vllm_expert_offload.integration.patching import require_checked_version

        require_checked_version("the crash-line hook", older)
    monkeypatch.setenv(versions.OVERRIDE_ENV, "1")
    assert versions.check_vllm_version(older) == versions.vllm_series(older)


def test_kv_fix_installs_on_a_newer_vllm_and_refuses_an_older_one() -> None:
    from vllm_expert_offload.integration.vllm_hooks import install_kv_fix

    install_kv_fix()
    assert install_kv_fix("0.34.0") == []  # checked, and already in: nothing to wrap again
    with pytest.raises(HookError, match=r"older vLLM 0\.31\.0.*Set VLLM_EXPERT_OFFLOAD_KV_FIX=0 to start without it"):
        install_kv_fix("0.31.0")


def test_plugin_registers_and_plans_on_a_newer_vllm(monkeypatch: pytest.MonkeyPatch, warnings: list[str],
                                                    capsys: pytest.CaptureFixture) -> None:
    """register() with vLLM reporting 0.35: a warning, the hooks in, and check-kv plans DeepSeek-V4.1 on SM120."""
    import argparse

    import vllm

    from vllm_expert_offload.integration import plugin
    from vllm_expert_offload.tools import check_kv_cmd

    monkeypatch.setattr(vllm, "__version__", "0.35.0")
    monkeypatch.setattr(versions, "_warned", set())
    monkeypatch.setattr(plugin, "_registered", False)
    plugin.register_plugin()
    assert warnings and "starting on vLLM 0.35.0 anyway" in warnings[0]
    args = argparse.Namespace(model_dir=FIXTURES / "deepseek_v41_flash", block_size=64, tp=1, attention_backend=None,
                              gpu_arch="sm120", max_model_len=8192, kv_gib=32.0)
    assert check_kv_cmd.run(args) == 0
    out = capsys.readouterr().out
    assert "vLLM 0.35.0, KV block-size fix on" in out and out.rstrip().endswith("OK")


def _fake_module(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    module = types.ModuleType("vllm.fake_hooked")

    class Backend:
        @staticmethod
        def sizes(kv_cache_spec=None):
            return [128]

        @classmethod
        def build(cls, engine_args, usage_context=None):
            return (cls.__name__, engine_args)

    module.target = lambda backend, spec: spec
    module.Backend = Backend
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def test_hook_refuses_a_changed_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    module = _fake_module(monkeypatch)
    with pytest.raises(HookError, match=r"vllm.fake_hooked.target takes \('backend', 'spec'\); the hook was written "
                                        r"for \('spec',\) \(vLLM 0\.32, 0\.33\)\. This vLLM changed it: the plugin "
                                        r"refuses to patch it blindly"):
        Hook(module.__name__, "target", ("spec",), lambda fn: fn).install()
    with pytest.raises(HookError, match=r"Backend.sizes takes \('kv_cache_spec',\); the hook was written for \(\)"):
        Hook(module.__name__, "Backend.sizes", (), lambda fn: fn).install()
    with pytest.raises(HookError, match="vllm.fake_hooked.Backend.missing does not exist in this vLLM"):
        Hook(module.__name__, "Backend.missing", (), lambda fn: fn).install()
    assert module.target(None, 0) == 0 and not getattr(module.Backend.sizes, SENTINEL, False)


def test_hook_keeps_the_kind_of_what_it_wraps(monkeypatch: pytest.MonkeyPatch) -> None:
    """A staticmethod stays callable on the class without an instance, a classmethod gets its class; twice is once."""
    module = _fake_module(monkeypatch)
    hooks = [
        Hook(module.__name__, "target", ("backend", "spec"), lambda fn: lambda b, s: (fn(b, s), 1)),
        Hook(module.__name__, "Backend.sizes", ("kv_cache_spec",), lambda fn: lambda kv_cache_spec=None: fn() + [64]),
        Hook(module.__name__, "Backend.build", ("cls", "engine_args", "usage_context"),
             lambda fn: lambda cls, engine_args, usage_context=None: fn(cls, engine_args)[::-1]),
    ]
    assert all(hook.install() for hook in hooks) and not any(hook.install() for hook in hooks)
    assert module.target(None, 0) == (0, 1)
    assert module.Backend.sizes() == [128, 64] and module.Backend().sizes(None) == [128, 64]
    assert module.Backend.build("args") == ("args", "Backend")


def test_startup_hooks_go_through_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """The crash line and the engine-construction hooks install once each, keep `from_engine_args` a
    classmethod, and refuse a changed signature like every other hook."""
    import vllm.entrypoints.launchers.api_server.entry  # noqa: F401  (the API process has them loaded)
    import vllm.v1.engine.llm_engine as llm_engine
    import vllm.v1.worker.gpu_worker as gpu_worker

    from vllm_expert_offload.integration.vllm_hooks import install_crash_line, install_engine_hooks

    install_crash_line(0.03, [1])
    install_engine_hooks()
    assert not install_crash_line(0.03, [1]) and install_engine_hooks() == 0
    assert getattr(gpu_worker.Worker.initialize_from_config, SENTINEL, False)
    factory = llm_engine.LLMEngine.__dict__["from_engine_args"]
    assert isinstance(factory, classmethod) and getattr(factory.__func__, SENTINEL, False)

    def changed(self, kv_cache_config, extra):
        return None

    monkeypatch.setattr(gpu_worker.Worker, "initialize_from_config", changed)
    with pytest.raises(HookError, match=r"Worker.initialize_from_config takes \('self', 'kv_cache_config', 'extra'\)"):
        install_crash_line(0.03, [1])
