"""Whether this process is inside vLLM's memory-profiling pass: a flag the startup hook raises around it
(integration/startup/profiling.py) and that layer code and backends read, so neither reaches up into the hook. (The
profiling pass runs eagerly, before any CUDA-graph capture; per-step facts a replayed graph must see, such as which
rows are padding, are device data instead: integration/methods/moe_runtime.py.)

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


def profiling() -> bool:
    return bool(_PROFILING)


def profiling_pass() -> contextlib.AbstractContextManager[None]:
    return _PROFILING.raised()
