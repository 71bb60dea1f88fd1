"""Test-time helpers: tiny EXL3 MoE checkpoints and their dense twins, built locally and cached."""

from .tiny_models import (
    ARCHITECTURES,
    ENCODE_CODE,
    build_dense_twin,
    build_hf_model,
    build_tiny_model,
    cached_fixture,
    fixture_cache_dir,
)

__all__ = [
    "ARCHITECTURES", "ENCODE_CODE", "build_dense_twin", "build_hf_model", "build_tiny_model", "cached_fixture",
    "fixture_cache_dir",
]
