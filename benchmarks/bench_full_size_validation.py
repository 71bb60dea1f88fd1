"""Startup header validation of the seeds' pack at full size (DeepSeek-V4.1-Flash, 188,245 tensors, 305 GiB):
time to write the header-only copy, open its headers, validate it (what `maybe_update_config` runs before any
layer is built) and compute the plan's ledger at TP 2.

    .venv/bin/python benchmarks/bench_full_size_validation.py [--pack dsv41-flash] [--repeats 3] [--keep DIR]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from vllm_expert_offload.exl3.checkpoint import Exl3Checkpoint
from vllm_expert_offload.exl3.residency import ResidencyOptions
from vllm_expert_offload.exl3.validate import validate_checkpoint
from vllm_expert_offload.testing.full_size_packs import PACKS, write_pack
from vllm_expert_offload.tools.plan_cmd import expert_sizes, plan_ledger
from vllm_expert_offload.units import GIB


def _timed(fn, cpu: list[float] | None = None):
    """(result, wall seconds); appends the process CPU seconds to `cpu` (the machine may be shared)."""
    start, start_cpu = time.perf_counter(), time.process_time()
    result = fn()
    if cpu is not None:
        cpu.append(time.process_time() - start_cpu)
    return result, time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack", choices=sorted(PACKS), default="dsv41-flash")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep", type=Path, help="write the pack here and keep it (default: a temporary dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = args.keep or Path(tmp) / args.pack
        stats, write_s = _timed(lambda: write_pack(args.pack, out))
        print(f"{args.pack}: {stats['tensors']:,} tensors, {stats['bytes'] / GIB:.1f} GiB in {stats['shards']} "
              f"shards, written in {write_s:.1f} s")
        opens, validations, validation_cpu = [], [], []
        for _ in range(args.repeats):
            ckpt, open_s = _timed(lambda: Exl3Checkpoint.open(out))
            summary, validate_s = _timed(lambda: validate_checkpoint(ckpt), validation_cpu)
            opens.append(open_s)
            validations.append(validate_s)
        (_, sizes, _), sizes_s = _timed(lambda: expert_sizes(ckpt, 2, summary))
        (ledger, _), ledger_s = _timed(lambda: plan_ledger(ckpt, summary, np.ones(sizes.shape, dtype=bool), sizes,
                                                           ResidencyOptions(tp=2)))
        print(f"open headers: median {statistics.median(opens):.2f} s (runs {', '.join(f'{t:.2f}' for t in opens)})")
        print(f"validate:     median {statistics.median(validations):.2f} s "
              f"(runs {', '.join(f'{t:.2f}' for t in validations)}; CPU {statistics.median(validation_cpu):.2f} s)")
        print(f"plan at TP 2: expert record sizes {sizes_s:.2f} s, ledger {ledger_s:.2f} s; "
              f"{ledger.gpu_weight_bytes / GIB:.2f} GiB weights per GPU with every expert on the GPUs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
