"""Builds the CPU tier's compiled kernels (kernels/cpu_exl3.py's extension) ahead of time, instead of at their first
use: `python -m vllm_expert_offload.tools.cpu_kernel_build [--check]`.

scripts/gpu-check.sh starts it first, in the background and within its own budget, so that no GPU test is killed
while it compiles the extension at first use (about 100 s of g++ on one core). It says what it built, where and in
how many seconds, or that a finished build was already there; it refuses (exit 1), naming what is missing, where it
cannot build (no compiler, no ninja, no Python headers) or the build fails. `--check` builds nothing: it says where
the build would go and what is missing, refusing likewise (what a dry run of the GPU check runs).
"""

from __future__ import annotations

import argparse
import sys
import time

from ..kernels.cpu_exl3 import EXTENSION
from ..kernels.cpu_extension import (COMPLETE_FILE, CpuKernelUnavailable, build_directory, load_extension,
                                     missing_build_tools)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_expert_offload.tools.cpu_kernel_build", description=__doc__)
    parser.add_argument("--check", action="store_true", help="build nothing: say where and what is missing")
    args = parser.parse_args(argv)
    directory = build_directory(EXTENSION)
    main_source = EXTENSION.sources[0]
    if (directory / COMPLETE_FILE).is_file():
        print(f"{EXTENSION.name}: already built in {directory}")
        return 0
    if args.check:
        missing = missing_build_tools()
        if missing:
            print(f"{EXTENSION.name}: cannot build {main_source} here: missing {'; '.join(missing)}", file=sys.stderr)
            return 1
        print(f"{EXTENSION.name}: would build {main_source} into {directory} (--check: nothing built)")
        return 0
    print(f"{EXTENSION.name}: building {main_source} into {directory}", flush=True)
    start = time.monotonic()
    try:
        load_extension(EXTENSION)
    except CpuKernelUnavailable as exc:
        print(f"{EXTENSION.name}: not built: {exc}", file=sys.stderr)
        return 1
    print(f"{EXTENSION.name}: built in {directory} in {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
