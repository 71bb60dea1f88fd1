"""Random EXL3 tensor sets for kernel and decoder tests, built from the exact-arithmetic reference's trellis."""

from __future__ import annotations

import numpy as np
import torch

from . import exl3_reference as ref

MARKERS = {"mul1": ref.MUL1_MARKER_INT32, "mcg": ref.MCG_MARKER_INT32}


def random_scales(rng: np.random.Generator, n: int) -> np.ndarray:
    """Signs × scales as exllamav3 stores them: fp16, both signs, magnitudes away from 1."""
    signs = rng.choice([-1.0, 1.0], size=n)
    return (signs * rng.uniform(0.25, 2.0, size=n)).astype(np.float16)


def make_layer(k: float, codebook: str, in_features: int, out_features: int, seed: int, bias: bool = False):
    rng = np.random.default_rng(seed)
    trellis = ref.random_trellis(rng, in_features // 16, out_features // 16, k)
    tensors = {
        "trellis": torch.from_numpy(trellis),
        "suh": torch.from_numpy(random_scales(rng, in_features)),
        "svh": torch.from_numpy(random_scales(rng, out_features)),
    }
    if codebook in MARKERS:
        tensors[codebook] = torch.tensor(MARKERS[codebook], dtype=torch.int32)
    if bias:
        tensors["bias"] = torch.from_numpy(rng.standard_normal(out_features).astype(np.float16))
    return tensors
