"""Switching the compiled CPU kernels to one instruction set for a test, skipping where the CPU lacks it."""

from __future__ import annotations

import pytest

ISAS = ("baseline", "avx2", "avx512")


def use_isa(extension: object, isa: str) -> None:
    """Run the extension's kernels with `isa`; skip the test when this CPU cannot (the refusal must say so)."""
    try:
        extension.exl3_set_cpu_isa(isa)
    except RuntimeError as exc:
        assert "does not support" in str(exc)
        pytest.skip(f"this CPU has no {isa}")
