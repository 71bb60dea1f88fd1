"""Shared test setup: CPU-only environment defaults and the `gpu` marker's skip."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run on CPU tensors only in the interpreter; set before anything imports Triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
