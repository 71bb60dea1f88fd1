"""What vLLM is running in this process besides real requests, as the MoE path must know it: its memory-profiling
pass, or a data-parallel dummy batch. One object, `PHASE`, holds both; the startup hooks raise its flags around
those runs (integration/startup/profiling.py, data_parallel.py, installed by integration/vllm_hooks.py) and layer
code and backends read them, so neither reaches up into the hooks.

While `profiling` is up the MoE path shows vLLM its worst case (every expert, host tier included) and kernels that
tune or allocate on first use do it then, before any CUDA-graph capture. While `dummy_batch` is up an engine with no
request of its own steps anyway, so the other engines' MoE collectives meet; its tokens are no one's and are never
counted.
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
    """The process's two flags, read as booleans and raised by their `..._pass()` blocks."""

    def __init__(self) -> None:
        self._profiling = _Flag()
        self._dummy_batch = _Flag()

    @property
    def profiling(self) -> bool:
        return bool(self._profiling)

    @property
    def dummy_batch(self) -> bool:
        return bool(self._dummy_batch)

    def profiling_pass(self) -> contextlib.AbstractContextManager[None]:
        return self._profiling.raised()

    def dummy_batch_pass(self) -> contextlib.AbstractContextManager[None]:
        return self._dummy_batch.raised()


PHASE = Phase()
