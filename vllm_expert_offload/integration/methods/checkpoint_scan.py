"""Find and validate the checkpoint a vLLM engine is about to load, from its safetensors headers."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path

from ...exl3.checkpoint import Exl3Checkpoint
from ...exl3.errors import Exl3FormatError
from ...exl3.validate import CheckpointSummary, validate_checkpoint


def resolve_model_dir(model: str, revision: str | None = None) -> Path:
    """A local directory, or a Hugging Face repo id already in the local cache (no download here)."""
    if os.path.isdir(model):
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception as exc:  # huggingface_hub raises several unrelated types for "not cached"
        raise Exl3FormatError(
            f"--model {model}: not a local directory and not in the Hugging Face cache ({exc}); "
            f"download it first so its EXL3 tensors can be validated before serving"
        ) from exc


@lru_cache(maxsize=4)
def scan_checkpoint(model_dir: str) -> CheckpointSummary:
    """Validated once per process and directory: config parsing runs several times during startup."""
    return validate_checkpoint(Exl3Checkpoint.open(model_dir))
