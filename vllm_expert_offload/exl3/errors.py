"""One error type for everything wrong with a checkpoint, so callers can refuse it before serving."""

from __future__ import annotations

from ..errors import ExpertOffloadError


class Exl3FormatError(ExpertOffloadError, ValueError):
    """A checkpoint, tensor set or quantization_config that EXL3 kernels cannot use; the message names the tensor."""
