"""A tensor over a raw CUDA address, so a test reads exactly what a kernel would read there (no copy)."""

from __future__ import annotations

import torch


class CudaArrayInterface:
    """Exposes a raw device address to torch.as_tensor, so a CUDA kernel reads exactly that address (no copy)."""

    def __init__(self, address: int, shape: tuple[int, ...], dtype: torch.dtype):
        typestr = {torch.int16: "<i2", torch.float16: "<f2", torch.uint8: "|u1"}[dtype]
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (address, False), "version": 2}


def device_alias(address: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.as_tensor(CudaArrayInterface(address, tuple(shape), dtype), device="cuda")
