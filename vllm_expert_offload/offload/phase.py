"""Whether this process is inside vLLM's memory-profiling pass, or a data-parallel dummy batch: flags the startup
hooks raise around them (integration/startup/profiling.py, data_parallel.py) and that layer code and backends read,
so neither reaches up into the hooks.

While the profiling flag is up the MoE path shows vLLM its worst case (every expert, host tier included) and kernels that tune or
allocate on first use do it then, before any CUDA-graph capture.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class _Phase:
    """A flag raised while a `with` block runs (nested blocks keep it up until the outermost ends)."""

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


_PROFILING = _Phase()
_DUMMY_BATCH = _Phase()


def profiling() -> bool:
    return bool(_PROFILING)


def profiling_pass() -> contextlib.AbstractContextManager[None]:
    return _PROFILING.raised()


def dummy_batch() -> bool:
    """Whether this process is inside a data-parallel dummy batch: an engine with no request of its own steps
    anyway, so the other engines' MoE collectives meet; its tokens are no one's and are never counted."""
    return bool(_DUMMY_BATCH)


def dummy_batch_pass() -> contextlib.AbstractContextManager[None]:
    return _DUMMY_BATCH.raised()
