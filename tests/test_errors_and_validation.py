"""The refusal family and the shared config checks (vllm_expert_offload/errors.py, validation.py)."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import vllm_expert_offload
from vllm_expert_offload.errors import ExpertOffloadError
from vllm_expert_offload.validation import finite_number, refuse_unknown

# Internal control flow of one command and the test harness's own failure: not refusals of user input.
NOT_REFUSALS = {"StepFailed", "EngineFailed"}


class _Refused(ExpertOffloadError, ValueError):
    pass


def _error_classes() -> dict[str, type]:
    found = {}
    for info in pkgutil.walk_packages(vllm_expert_offload.__path__, "vllm_expert_offload."):
        if ".testing." in info.name or info.name.endswith("sitecustomize"):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if inspect.isclass(obj) and issubclass(obj, BaseException) and obj.__module__ == module.__name__:
                found[f"{module.__name__}.{name}"] = obj
    return found


def test_every_refusal_class_derives_from_the_base() -> None:
    classes = _error_classes()
    assert len(classes) >= 10  # the walk really found the package's error classes
    outside = [name for name, cls in classes.items()
               if not issubclass(cls, ExpertOffloadError) and name.rsplit(".", 1)[1] not in NOT_REFUSALS]
    assert outside == []


PACKAGE = Path(vllm_expert_offload.__file__).parent


def _plain_raises(source: str) -> list[int]:
    """Lines raising a bare ValueError or RuntimeError (a refusal outside the family)."""
    return [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Raise)
            and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name)
            and node.exc.func.id in ("ValueError", "RuntimeError")]


def test_no_shipped_module_raises_a_plain_value_or_runtime_error() -> None:
    """testing/ is test support (never imported by shipped code); every other refusal is a family member, which
    keeps ValueError or RuntimeError as its builtin base for callers that catch those."""
    found = [f"{path.relative_to(PACKAGE)}:{line}" for path in sorted(PACKAGE.rglob("*.py"))
             if path.relative_to(PACKAGE).parts[0] != "testing"
             for line in _plain_raises(path.read_text())]
    assert found == []
    assert _plain_raises("def f():\n    raise ValueError('x')\nraise RuntimeError\n") == [2]  # the scan sees one


def test_refuse_unknown_names_the_first_unknown_key() -> None:
    refuse_unknown({"bits": 3}, {"bits", "codebook"}, "quantization_config", _Refused)
    with pytest.raises(_Refused, match=r"^quantization_config\.bitz: unknown key \(known: \['bits', 'codebook'\]\)$"):
        refuse_unknown({"bitz": 3, "zz": 1}, {"bits", "codebook"}, "quantization_config", _Refused)


@pytest.mark.parametrize(("value", "message"), [
    (True, "is not a number"), ("3", "is not a number"), (None, "is not a number"),
    (float("nan"), "is not a finite number"), (float("inf"), "is not a finite number"),
    (10**400, "an integer of 1329 bits is too large"), (7, r"7 is outside \[0, 5\]"),
])
def test_finite_number_refuses_what_is_not_a_usable_number(value: object, message: str) -> None:
    with pytest.raises(_Refused, match=f"^key: .*{message}|^key: {message}"):
        finite_number(value, "key", _Refused, lo=0, hi=5)


def test_finite_number_accepts_ints_and_floats_in_range() -> None:
    assert finite_number(5, "key", _Refused, lo=0, hi=5) == 5.0
    assert finite_number(0.25, "key", _Refused) == 0.25
