"""Installs tests/support/cpu_gatherv.py (the test-only all_gatherv / reduce_scatterv for vLLM 0.32's CPU
communicator) at interpreter start, in every process of a `vllm serve` a test launches with this directory on
PYTHONPATH: the API server, each data-parallel engine core and its workers all import vLLM before test code could
run in them. Put on PYTHONPATH only by tests (cpu_gatherv.serve_env); the plugin never installs it."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/support, for cpu_gatherv
import cpu_gatherv  # noqa: E402

del sys.path[0]
cpu_gatherv.install()
