"""The rooflines of every GPU kernel row: how fast this GPU reads HBM, copies pinned host memory in, and reads mapped
host memory in place, coalesced by read size and in each backend's own trellis access pattern.

    python3 benchmarks/gpu_bandwidth_probe.py --out probe.jsonl            # CUDA
    TRITON_INTERPRET=1 python3 benchmarks/gpu_bandwidth_probe.py --smoke --out probe.jsonl   # CPU, code path only

Every figure is one JSON line appended to --out as soon as it is measured (a crash keeps what came before); the last
line (`"probe": "rooflines"`) sums them up for benchmarks/bench_gpu_kernels.py. Host memory is the plugin's own
HostArena (one mmap, MADV_DONTFORK, cudaHostRegister MAPPED|PORTABLE, read through its device alias), so the figures
are those of the host tier as served. Where this runtime refuses the registration (or MADV_DONTFORK), that is a row of
its own (`"probe": "host_arena", "status": "failed"`) and the host-tier reads fall back to a torch pinned buffer
(cudaHostAlloc, mapped under UVA), said so in each row.

- hbm_read / host_read: a Triton kernel reads `chunks` chunks of `read_bytes` each (at addresses from a table, as the
  kernels read experts), 16-byte vector loads coalesced across each warp, 4 KiB to 256 MiB per chunk, the chunks of one
  launch adding up to `total_bytes`; plus the time of a single chunk alone (latency, launch included).
- h2d_copy: cudaMemcpyAsync (Tensor.copy_) of pinned host memory to VRAM by size: the copy engine, which the torch
  reference's per-batch reads of host-tier experts use.
- pattern: one projection per selected expert (a Qwen3-30B-A3B gate: 2048 x 768, K=3) read in the access pattern of
  the Triton kernel (each thread of a 64x64 block loads the few consecutive 32-bit words of one 32-position group of
  a tile, `group_words` of kernels/triton_decode.py, on the kernel's own decode grid: one program per (expert, 64
  columns)) and of exllamav3's
  kernels (each 16-row tile row read as contiguous runs of 8 tiles, 128 columns, by 4-byte loads of consecutive
  lanes, the rows split 16 ways: exl3_gemm's TILESIZE_N 128 and exl3_moe_coop's gemv_tile over 16 warps).
Timing: CUDA events around each launch, the L2 flushed before each (a write of twice its size), median of the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

from vllm_expert_offload.kernels.triton_decode import group_span, group_words
from vllm_expert_offload.memory.arena import HostArena

KIB, MIB = 2**10, 2**20
FULL = {"read_sizes": [4 * KIB * 4**i for i in range(9)], "total_bytes": 256 * MIB, "host_bytes": 1024 * MIB,
        "hbm_bytes": 2048 * MIB, "copy_sizes": [64 * KIB, 1 * MIB, 16 * MIB, 256 * MIB], "repeats": 15,
        "pattern": {"in": 2048, "out": 768, "k": 3, "matrices": 8}}
SMOKE = {"read_sizes": [4 * KIB, 64 * KIB], "total_bytes": 64 * KIB, "host_bytes": 1 * MIB, "hbm_bytes": 1 * MIB,
         "copy_sizes": [64 * KIB], "repeats": 2, "pattern": {"in": 128, "out": 128, "k": 3, "matrices": 2}}
READ_BLOCK = 1024  # int32 words (4 KiB) per step of a program: 8 words per thread, two 16-byte loads
READ_STEPS = 16  # steps per program: 64 KiB per program
EXL3_RUN_TILES = 8  # tiles read side by side per tile row in exllamav3's pattern
EXL3_K_SPLIT = 16  # its tile rows split over 16 warps (exl3_moe_coop's gemv_tile), so as many programs here


def _divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, limit + 1) if n % d == 0)


class JsonLines:
    """Appends one JSON object per line and flushes it to disk at once."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, row: dict) -> dict:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return row


def rooflines(path: Path) -> dict | None:
    """The last `rooflines` summary in a probe's JSON lines, or None when the probe did not get that far."""
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    found = [r for r in rows if r.get("probe") == "rooflines"]
    return found[-1] if found else None


@triton.jit
def _read_chunks(table_ptr, out_ptr, chunk_words, parts, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    """XOR of every word of chunk `program_id(0)`'s part `program_id(1)` (its address read from the table); chunks
    on the first grid axis, which holds 2^31 - 1 programs (the others hold 65535)."""
    chunk, part = tl.program_id(0), tl.program_id(1)
    # The table's chunk addresses are 16-byte aligned (_chunk_table checks it); without the hint Triton cannot know a
    # loaded pointer's alignment and compiles every read to 4-byte loads (ld.global.b32 instead of .v4.b32)
    base = tl.multiple_of(tl.load(table_ptr + chunk).to(tl.pointer_type(tl.int32)), 16)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for step in range(STEPS):
        offs = (part * STEPS + step) * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(base + offs, mask=offs < chunk_words, other=0)
    tl.store(out_ptr + chunk * parts + part, tl.reduce(acc, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _triton_pattern(table_ptr, out_ptr, size_k, size_n, TWICE_K: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """The loads of kernels/triton_decode.py's decode_block (its `group_words`) for one matrix per program row,
    without the decode."""
    matrix, col_block = tl.program_id(0), tl.program_id(1)
    trellis = tl.load(table_ptr + matrix)
    acc = tl.zeros((BLOCK_K // 16, BLOCK_N // 16, 8), dtype=tl.uint32)
    for k0 in range(0, size_k, BLOCK_K):
        words = group_words(trellis, k0, col_block * BLOCK_N, size_n, TWICE_K, BLOCK_K, BLOCK_N)
        for a in tl.static_range(group_span(TWICE_K)):
            acc ^= words[a]
    acc = tl.reduce(tl.reduce(tl.reduce(acc, 2, _xor), 1, _xor), 0, _xor)
    tl.store(out_ptr + matrix * tl.num_programs(1) + col_block, acc.to(tl.int32, bitcast=True))


@triton.jit
def _exllamav3_pattern(table_ptr, out_ptr, rows_per_part, row_words, run_words, BLOCK: tl.constexpr):
    """Per 16-row tile row, one contiguous run of 8 tiles (128 columns) read by consecutive lanes' 4-byte loads; the
    tile rows split over `program_id(2)` as exllamav3 splits k over warps and blocks."""
    matrix, run, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    trellis = tl.load(table_ptr + matrix).to(tl.pointer_type(tl.int32))
    lanes = tl.arange(0, BLOCK)
    offs = run * run_words + lanes
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for row in range(part * rows_per_part, (part + 1) * rows_per_part):
        acc ^= tl.load(trellis + row * row_words + offs, mask=lanes < run_words, other=0)
    index = (matrix * tl.num_programs(1) + run) * tl.num_programs(2) + part
    tl.store(out_ptr + index, tl.reduce(acc, 0, _xor))


class Clock:
    """Median seconds of a launch: CUDA events with the L2 flushed before each on a GPU, wall clock on a CPU."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.device, self.repeats = device, repeats
        l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 0
        self.flush = torch.empty(max(2 * l2, 1), dtype=torch.uint8, device=device)

    def seconds(self, launch: Callable[[], object], repeats: int | None = None) -> float:
        launch()  # compile, first touch
        return statistics.median(self.times(launch, repeats or self.repeats))

    def times(self, launch: Callable[[], object], repeats: int,
              prepare: Callable[[int], object] | None = None) -> list[float]:
        """Seconds of each of `repeats` launches; `prepare(i)` runs before repeat i, untimed (new inputs)."""
        times = []
        for i in range(repeats):
            if prepare is not None:
                prepare(i)
            self.flush.fill_(1)
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                launch()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                launch()
                times.append(time.perf_counter() - t0)
        return times


class HostMemory:
    """Host bytes the GPU reads in place: the plugin's HostArena, or a torch pinned buffer where the arena cannot be
    registered here (with the reason)."""

    def __init__(self, nbytes: int, device: torch.device, out: JsonLines) -> None:
        self.arena, self.kind = None, "host_arena"
        try:
            self.arena = HostArena(nbytes, device=device)
            self.arena.reserve(nbytes)
            self.buffer = self.arena.view(0, (nbytes,), torch.uint8)
            out.write({"probe": "host_arena", "status": "registered", "bytes": nbytes})
        except (OSError, RuntimeError, ValueError) as exc:  # CudaError is a RuntimeError; MADV_DONTFORK an OSError
            out.write({"probe": "host_arena", "status": "failed", "error": f"{type(exc).__name__}: {exc}",
                       "fallback": "torch pinned memory (cudaHostAlloc)"})
            self.kind = "torch_pinned"
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.buffer.fill_(7)  # pages resident before anything is timed

    def address(self, offset: int) -> int:
        """What a kernel dereferences for byte `offset`: the arena's device alias, or the UVA pointer."""
        return self.arena.device_address(offset) if self.arena is not None else self.buffer.data_ptr() + offset


def _chunk_table(base: Callable[[int], int], region: int, read_bytes: int, chunks: int, rotation: int,
                 device: torch.device) -> torch.Tensor:
    """Addresses of `chunks` chunks spread over the region, shifted by `rotation` slots (a different set each time)."""
    slots = max(region // read_bytes, 1)
    step = max(slots // chunks, 1)
    picks = [((i * step + rotation) % slots) * read_bytes for i in range(chunks)]
    addresses = [base(p) for p in picks]
    if any(address % 16 for address in addresses):
        raise ValueError(f"_read_chunks reads 16-byte vectors: chunk addresses must be 16-byte aligned "
                         f"(region base {base(0):#x}, read size {read_bytes})")
    return torch.tensor(addresses, dtype=torch.int64, device=device)


def probe_reads(tier: str, base: Callable[[int], int], region: int, shape: dict, clock: Clock, out: JsonLines,
                extra: dict) -> dict[int, float]:
    """GB/s of coalesced reads by chunk size from one region (VRAM or host), each launch over fresh chunks."""
    device, rates = clock.device, {}
    for read_bytes in shape["read_sizes"]:
        if read_bytes > region:
            continue
        chunks = max(min(shape["total_bytes"], region // 2) // read_bytes, 1)
        words = read_bytes // 4
        steps = min(READ_STEPS, -(-words // READ_BLOCK))
        parts = -(-words // (READ_BLOCK * steps))
        sink = torch.empty(chunks * parts, dtype=torch.int32, device=device)
        tables = [_chunk_table(base, region, read_bytes, chunks, r, device) for r in range(4)]
        turn = iter(range(10**9))

        def launch(n=chunks, t=tables):
            _read_chunks[(n, parts)](t[next(turn) % len(t)], sink, words, parts, BLOCK=READ_BLOCK, STEPS=steps)

        many = clock.seconds(launch)
        single = clock.seconds(lambda: launch(1))
        rates[read_bytes] = chunks * read_bytes / many / 1e9
        out.write({"probe": f"{tier}_read", "read_bytes": read_bytes, "chunks": chunks,
                   "total_bytes": chunks * read_bytes, "seconds": many, "gbs": rates[read_bytes],
                   "single_read_s": single, **extra})
    return rates


def probe_copies(host: HostMemory, shape: dict, clock: Clock, out: JsonLines) -> dict[int, float]:
    rates = {}
    for size in shape["copy_sizes"]:
        if size > host.buffer.numel():
            continue
        source = host.buffer[:size]
        target = torch.empty(size, dtype=torch.uint8, device=clock.device)
        seconds = clock.seconds(lambda: target.copy_(source, non_blocking=True))
        rates[size] = size / seconds / 1e9
        out.write({"probe": "h2d_copy", "bytes": size, "seconds": seconds, "gbs": rates[size], "host": host.kind})
    return rates


def probe_patterns(tier: str, base: Callable[[int], int], region: int, shape: dict, clock: Clock, out: JsonLines,
                   extra: dict) -> dict[str, float]:
    """GB/s of one projection per selected expert read in each backend's pattern (matrices spread over the region)."""
    p, device = shape["pattern"], clock.device
    k_int, k_half = int(p["k"]), int(2 * p["k"]) % 2
    units = 16 * k_int + 8 * k_half
    matrix_bytes = (p["in"] // 16) * (p["out"] // 16) * units * 2
    matrices = min(p["matrices"], max(region // matrix_bytes // 2, 1))
    tables = [_chunk_table(base, region, matrix_bytes, matrices, r, device) for r in range(4)]
    turn = iter(range(10**9))
    rates = {}
    blocks_n = p["out"] // 64
    runs, splits = p["out"] // (16 * EXL3_RUN_TILES), _divisor_at_most(p["in"] // 16, EXL3_K_SPLIT)
    sink = torch.empty(matrices * max(blocks_n, runs * splits), dtype=torch.int32, device=device)
    launches = {
        "triton": lambda: _triton_pattern[(matrices, blocks_n)](
            tables[next(turn) % 4], sink, p["in"], p["out"], TWICE_K=int(2 * p["k"]), BLOCK_N=64, BLOCK_K=64),
        "exllamav3": lambda: _exllamav3_pattern[(matrices, runs, splits)](
            tables[next(turn) % 4], sink, p["in"] // 16 // splits, (p["out"] // 16) * units // 2,
            EXL3_RUN_TILES * units // 2,
            BLOCK=triton.next_power_of_2(EXL3_RUN_TILES * units // 2)),
    }
    for backend, launch in launches.items():
        seconds = clock.seconds(launch)
        rates[backend] = matrices * matrix_bytes / seconds / 1e9
        out.write({"probe": "pattern", "backend": backend, "tier": tier, "matrix": [p["in"], p["out"]], "k": p["k"],
                   "matrices": matrices, "bytes": matrices * matrix_bytes, "seconds": seconds, "gbs": rates[backend],
                   **extra})
    return rates


def _vram_probes(shape: dict, clock: Clock, out: JsonLines) -> tuple[dict[int, float], dict[str, float]]:
    """Reads of a VRAM buffer (freed on return, before the host buffers are made)."""
    vram = torch.full((shape["hbm_bytes"],), 7, dtype=torch.uint8, device=clock.device)
    base = vram.data_ptr()
    return (probe_reads("hbm", lambda o: base + o, vram.numel(), shape, clock, out, {}),
            probe_patterns("hbm", lambda o: base + o, vram.numel(), shape, clock, out, {}))


def run(shape: dict, device: torch.device, out: JsonLines) -> dict:
    clock = Clock(device, shape["repeats"])
    out.write({"probe": "setup", "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "triton": triton.__version__, "repeats": shape["repeats"],
               "l2_bytes": clock.flush.numel() // 2})
    hbm, hbm_patterns = _vram_probes(shape, clock, out)
    host = HostMemory(shape["host_bytes"], device, out)
    kind = {"host": host.kind}
    host_reads = probe_reads("host", host.address, host.buffer.numel(), shape, clock, out, kind)
    host_patterns = probe_patterns("host", host.address, host.buffer.numel(), shape, clock, out, kind)
    copies = probe_copies(host, shape, clock, out)
    summary = {"probe": "rooflines", "hbm_gbs": max(hbm.values()), "host_read_gbs": max(host_reads.values()),
               "host_read_gbs_by_size": {str(k): v for k, v in host_reads.items()}, "h2d_copy_gbs": max(copies.values()),
               "host_pattern_gbs": {**host_patterns, "torch": max(copies.values())},
               "hbm_pattern_gbs": hbm_patterns, "host": host.kind}
    return out.write(summary)


def choose_device(parser: argparse.ArgumentParser, smoke: bool) -> torch.device:
    """The CPU under Triton's interpreter for --smoke (the code path only), else the first CUDA device, else an error."""
    if smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--smoke runs Triton on the CPU: set TRITON_INTERPRET=1")
        return torch.device("cpu")
    if not torch.cuda.is_available():
        parser.error("no CUDA device (use --smoke for the CPU code path)")
    return torch.device("cuda", 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON lines file to append to")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU under TRITON_INTERPRET=1")
    args = parser.parse_args(argv)
    device = choose_device(parser, args.smoke)
    summary = run(SMOKE if args.smoke else FULL, device, JsonLines(args.out))
    print(f"HBM {summary['hbm_gbs']:.0f} GB/s; host ({summary['host']}) coalesced {summary['host_read_gbs']:.1f} GB/s, "
          f"triton pattern {summary['host_pattern_gbs']['triton']:.1f}, exllamav3 pattern "
          f"{summary['host_pattern_gbs']['exllamav3']:.1f}; pinned H2D copy {summary['h2d_copy_gbs']:.1f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
