"""`quantize SRC DST --bits K`: convert a Hugging Face MoE checkpoint to EXL3 (exllamav3's layout)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..exl3.codebook import Codebook
from ..exl3.config import UNQUANTIZED_HEAD_BITS
from ..exl3.convert import DEFAULT_HEAD_BITS, ENCODERS, convert_checkpoint
from ..kernels import cpu_exl3  # noqa: F401  (offers the compiled Viterbi to the encoder)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "quantize", help="convert a Hugging Face MoE checkpoint to EXL3",
        description="Encode every linear (attention, MLPs, shared and routed experts) as EXL3; routers, norms and "
        "embeddings stay unquantized. The viterbi encoder uses no calibration data (exllamav3's fallback path); "
        "the random encoder writes valid but meaningless weights for tests.",
    )
    parser.add_argument("src", type=Path, metavar="SRC", help="Hugging Face checkpoint directory (safetensors)")
    parser.add_argument("dst", type=Path, metavar="DST", help="output directory (must be empty or absent)")
    parser.add_argument("--bits", type=float, required=True, help="bits per weight K: 1..8, or 1.5/2.5/3.5 with mul1")
    parser.add_argument(
        "--head-bits", type=float, default=DEFAULT_HEAD_BITS,
        help=f"bits for lm_head; {UNQUANTIZED_HEAD_BITS} keeps it unquantized (default {DEFAULT_HEAD_BITS})",
    )
    parser.add_argument("--codebook", choices=[c.value for c in Codebook], default=Codebook.MUL1.value)
    parser.add_argument("--encoder", choices=ENCODERS, default="viterbi")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random sign flips (and random trellises)")
    parser.add_argument(
        "--routed-only", action="store_true",
        help="write a mixed pack (docs/models.md): only routed experts in EXL3, every other tensor as stored, "
        "declared non_routed_dtype_policy bf16_as_stored; --head-bits does not apply",
    )
    parser.add_argument(
        "--layer-bits", type=_layer_bits, default={}, metavar="L=K[,L=K...]",
        help="with --routed-only: K of the routed experts of layer L (MixedK); others get --bits",
    )
    parser.set_defaults(handler=run)


def _layer_bits(text: str) -> dict[int, float]:
    try:
        return {int(layer): float(k) for layer, k in (item.split("=") for item in text.split(",") if item)}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected LAYER=K[,LAYER=K...], e.g. 3=3,13=3") from None


def run(args: argparse.Namespace) -> int:
    out = convert_checkpoint(
        args.src, args.dst, bits=args.bits, head_bits=args.head_bits, codebook=Codebook(args.codebook),
        encoder=args.encoder, seed=args.seed, routed_only=args.routed_only, layer_bits=args.layer_bits,
    )
    print(f"wrote {out}")
    return 0
