"""exllamav3's C++ declarations, read from the 1.6.5 wheel's headers (fetched by scripts/setup-cpu-venv.sh into
the ignored .cache/), as (argument name, kind) lists comparable with the backend's SIGNATURES."""

from __future__ import annotations

import os
import re
from pathlib import Path

from vllm_expert_offload.kernels.exllamav3_backend import BOOL, FLOAT, INT, OPTIONAL_TENSOR, TENSOR, VERSION

EXT = Path(os.environ.get("EXLLAMAV3_EXT_SOURCES",
                          Path(__file__).resolve().parents[2] / f".cache/exllamav3-{VERSION}/exllamav3/exllamav3_ext"))
HEADERS = {  # where each function we call is declared
    "exl3_moe_coop": "quant/exl3_moe_coop.cuh",
    "exl3_moe": "quant/exl3_moe.cuh",
    "exl3_moe_gather": "quant/exl3_moe.cuh",
    "exl3_moe_max_concurrency": "quant/exl3_moe.cuh",
    "exl3_gemm": "quant/exl3_gemm.cuh",
}
KINDS = {
    "at::Tensor": TENSOR, "c10::optional<at::Tensor>": OPTIONAL_TENSOR, "std::optional<at::Tensor>": OPTIONAL_TENSOR,
    "int": INT, "int64_t": INT, "uint32_t": INT, "float": FLOAT, "double": FLOAT, "bool": BOOL,
}


def header_text(name: str) -> str:
    path = EXT / HEADERS[name]
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run scripts/setup-cpu-venv.sh (it fetches exllamav3 {VERSION}'s "
                                "headers), or point EXLLAMAV3_EXT_SOURCES at an exllamav3_ext source folder")
    return path.read_text()


def declaration(text: str, name: str) -> list[tuple[str, str]]:
    """The (name, kind) list of `name`'s declaration in C++ `text`; kinds of unmapped types are the type itself."""
    text = re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)
    match = re.search(rf"\b[\w:]+\s+{re.escape(name)}\s*\(([^;]*?)\)\s*;", text)
    if match is None:
        raise LookupError(f"no declaration of {name}")
    arguments = []
    for parameter in filter(None, (p.split("=")[0].strip() for p in match.group(1).split(","))):
        ctype, argument = re.fullmatch(r"(.*?)\s*\b(\w+)", parameter).groups()
        ctype = re.sub(r"\bconst\b|&|\s", "", ctype)
        arguments.append((argument, KINDS.get(ctype, ctype)))
    return arguments


def header_signature(name: str) -> list[tuple[str, str]]:
    return declaration(header_text(name), name)
