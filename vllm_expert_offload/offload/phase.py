"""Whether this process is inside vLLM's memory-profiling pass: a flag the startup hook raises around the pass
(integration/startup/profiling.py) and that layer code and backends read, so neither reaches up into the hook.

While it is up the MoE path shows vLLM its worst case (every expert, host tier included) and kernels that tune or
allocate on first use do it then, before any CUDA-graph capture.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

_depth = 0


def profiling() -> bool:
    return _depth > 0


@contextlib.contextmanager
def profiling_pass() -> Iterator[None]:
    global _depth
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
