"""`check-kv MODEL_DIR --block-size N [--gpu-arch ARCH]`: would vLLM plan and accept this model's KV cache, on pages
its kernels have?

The steps themselves live in integration/kv/check.py (they call vLLM); this command parses the flags, makes vLLM's
capability queries answer for the GPU named (`tools/gpu_arch.py`) and prints the report: each distinct layer spec,
each group's block, kernel block and page sizes, each cache's kernel page against the kernel truth table, then `OK`
or `FAILED at <step>: <error>` (exit status 0 or 1).
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

from .gpu_arch import ARCHES, emulated


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "check-kv", help="check that vLLM can plan a model's KV cache at a block size (no weights, no GPU)"
    )
    parser.add_argument("model_dir", type=Path, metavar="MODEL_DIR")
    parser.add_argument("--block-size", type=int, required=True, help="the --block-size vLLM would be given")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    parser.add_argument(
        "--attention-backend", default=None,
        help="vLLM backend name: for standard attention layers (default FLASH_ATTN); for DeepSeek-V4.1 one of "
        "FLASHMLA_SPARSE_DSV41, FLASHMLA_MEGA_ATTN_DSV41, FLASHINFER_MLA_SPARSE_DSV41, for DeepSeek-V4 "
        "FLASHMLA_SPARSE_DSV4 or FLASHINFER_MLA_SPARSE_DSV4 (default: vLLM's pick for --gpu-arch)",
    )
    parser.add_argument(
        "--gpu-arch", choices=sorted(ARCHES), default=None,
        help="the NVIDIA GPU to plan for (sm90: H100/H200, sm100: B200, sm120: RTX PRO 6000); required for "
        "DeepSeek-V4.1, whose kernel block sizes depend on it; the kernel pages are checked for it",
    )
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--kv-gib", type=float, default=8.0, help="KV-cache memory per rank to plan with (GiB)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from ..integration.kv.check import KVCheckRequest, StepFailed, check_kv

    request = KVCheckRequest(
        args.model_dir, args.block_size, args.tp, args.attention_backend, args.gpu_arch, args.max_model_len,
        args.kv_gib,
    )
    try:
        check_kv(request, print, partial(emulated, args.gpu_arch))
    except StepFailed as failure:
        print(f"FAILED at {failure}")
        return 1
    print("OK")
    return 0
