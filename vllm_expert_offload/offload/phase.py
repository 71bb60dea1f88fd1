"""What vLLM is running in this process besides real requests, as the MoE path must know it: its memory-profiling
pass. One object, `PHASE`, holds the flag; the startup hook raises it around that pass (integration/startup/
profiling.py, installed by integration/vllm_hooks.py) and layer code and backends read it, so neither reaches up
into the hooks. (The profiling pass runs eagerly, before any CUDA-graph capture; per-step facts a replayed graph
must see, such as which rows are padding, are device data instead: integration/methods/moe_runtime.py.)

While `profiling` is up the MoE path shows vLLM its worst case (every expert, host tier included) and kernels that
tune or allocate on first use do it then, before any CUDA-graph capture.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class _Flag:
    """Up while a `with raised()` block runs (nested blocks keep it up until the outermost ends), so an exception
    inside the run drops it."""

    def __init__(self) -> None:
        self.depth = 0

    def __bool__(self) -> bool:
        return self.depth > 0

    @contextlib.contextmanager
    def raised(self) -> Iterator[None]:
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1


class Phase:
    """The process's profiling flag, read as a boolean and raised by its `profiling_pass()` block."""

    def __init__(self) -> None:
        self._profiling = _Flag()

    @property
    def profiling(self) -> bool:
        return bool(self._profiling)

    def profiling_pass(self) -> contextlib.AbstractContextManager[None]:
        return self._profiling.raised()


PHASE = Phase()
