"""One error type for everything wrong with a checkpoint, so callers can refuse it before serving."""

from __future__ import annotations

from ..errors import ExpertOffloadError


class Exl3FormatError(ExpertOffloadError, ValueError):
    """A checkpoint, tensor set or quantization_config that EXL3 kernels cannot use; the message names the tensor."""


class CheckpointRefused(ExpertOffloadError, ValueError):
    """vLLM was asked to serve an EXL3 checkpoint in a way the plugin refuses: a flag, a delegate config vLLM
    rejects, a table that does not fit; the message starts "EXL3 checkpoint refused:" and names what is at fault."""
