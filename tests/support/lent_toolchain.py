"""This Python's Triton made to report itself as the lent GPU machine's (Triton 3.6: its ptxas 12.8 for sm_90,
ptxas-blackwell 12.9 for sm_120), for tests of what the tools stamp on their measurements."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

LENT = {90: {"triton": "3.6.0", "ptxas": "12.8"}, 120: {"triton": "3.6.0", "ptxas": "12.9"}}


def pretend_lent_toolchain(monkeypatch: pytest.MonkeyPatch) -> None:
    import triton
    from triton.backends.nvidia import compiler

    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(compiler, "get_ptxas", lambda arch: SimpleNamespace(
        path=f"/lent/ptxas-{arch}", version=LENT[90 if arch < 100 else 120]["ptxas"]))
