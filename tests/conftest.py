"""Shared test setup: CPU-only environment defaults, the `gpu` marker's skip, the host arena's log."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

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
        if item.get_closest_marker("gpu") is not None:  # not `in item.keywords`: that holds directory names too
            item.add_marker(skip)


@pytest.fixture
def arena_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """caplog for the host arena's logger, a child of "vllm": once vLLM is imported its logger stops propagation,
    so caplog's root handler would see nothing; the handler is attached to the logger itself instead."""
    from vllm_expert_offload.memory import arena

    logger = arena.logger
    level, propagate = logger.level, logger.propagate
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # not seen twice where it would propagate to the root handler too
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(level)
        logger.propagate = propagate
