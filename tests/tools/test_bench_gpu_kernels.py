"""The GPU kernel benchmark's code path, run on the CPU at tiny shapes (Triton interpreter), so the script a
lent GPU runs has been executed before; the figures themselves mean nothing here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from support.paths import REPO

BENCH = REPO / "benchmarks" / "bench_gpu_kernels.py"


def test_smoke_run_writes_rows_with_bytes_by_tier_and_rooflines(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("bench_gpu_kernels", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    limits = tmp_path / "limits.json"
    limits.write_text(json.dumps({"hbm_kernel_read_gbs": {"64KiB": 1000.0, "1024KiB": 2000.0},
                                  "uva_kernel_read_gbs": {"16KiB": 10.0, "4096KiB": 25.0}, "h2d_copy_gbs": 26.0}))
    out = tmp_path / "out.json"
    assert bench.main(["--smoke", "--json", str(out), "--limits", str(limits)]) == 0
    result = json.loads(out.read_text())
    assert result["limits"] == {"hbm_gbs": 2000.0, "uva_gbs": 25.0, "h2d_copy_gbs": 26.0}
    moe = result["moe"]
    assert len(moe) == 2 * 2 * 2  # host shares x backends x token counts
    expert = 3 * (128 * 128 * 3 // 8 + 2 * 128 + 2 * 128 + 4)  # (trellis + suh + svh + marker) x 3 projections
    for row in moe:
        read = row["gpu_bytes"] + row["host_bytes"]
        assert read % expert == 0 and 0 < read <= 8 * expert
        assert (row["host_bytes"] == 0) == (row["host_share"] == 0.0)
        assert (row["gpu_bytes"] == 0) == (row["host_share"] == 1.0)
        want = row["gpu_bytes"] / 2000e9 + row["host_bytes"] / 25e9
        assert abs(row["roofline_s"] - want) <= 1e-12 and row["fraction_of_roofline"] == want / row["seconds"]
    assert [r["tokens"] for r in result["dense"]] == [1, 9] and all("exl3_triton_s" in r for r in result["dense"])
    assert result["backends"] == ["triton", "torch"]
    assert "its kernels are CUDA kernels" in result["skipped_backends"]["exllamav3"]
