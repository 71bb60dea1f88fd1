"""How the engine tests compile. Every engine here starts the way users start vLLM, without --enforce-eager, so
Dynamo traces the model through the plugin's ops. Tests marked `inductor` run the rest of vLLM's CPU default too:
Inductor's code generation and the runner's warm-up forward of a full batch (about 30 s more per engine start on
two cores). The others use vLLM's own CPU CI backend (`VLLM_CPU_CI_ENV=1`, vllm/platforms/cpu.py: the traced graph
runs without Inductor, no warm-up), which keeps the suite within its time while the marked tests cover Inductor
for every architecture, tensor parallelism and each backend that runs on a CPU."""

from __future__ import annotations

import os

import pytest

from support.engine_model import CPU_CI_BACKEND


@pytest.fixture(scope="module", autouse=True)
def _cpu_ci_backend():
    """Module scope and autouse, so it is in place before any module-scoped server starts."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CPU_CI_BACKEND, "1")
        yield


@pytest.fixture(autouse=True)
def _inductor_where_marked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("inductor") is not None:
        monkeypatch.delenv(CPU_CI_BACKEND)
    assert (os.environ.get(CPU_CI_BACKEND) is None) == (request.node.get_closest_marker("inductor") is not None)
