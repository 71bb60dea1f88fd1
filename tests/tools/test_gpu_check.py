"""scripts/gpu-check.sh on the CPU: --dry-run walks every step of the real run with the CUDA parts stubbed (the
plumbing a lent GPU machine will run: step order, bounds, results appended as JSON lines, vLLM's absence as a skip),
and without --dry-run it refuses at once. The GPU machine has no vLLM; a `vllm` that fails to import stands in for it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.paths import REPO
from vllm_expert_offload.tools import gpu_check_budget

SCRIPT = REPO / "scripts" / "gpu-check.sh"
STEPS = ["machine", "versions", "imports without vLLM", "topology", "bandwidth probe", "kernel benchmark", "GPU tests",
         "compiled forwards", "tiny EXL3 MoE on the CUDA engine", "tiny mixed pack", "summary"]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    blocked = tmp_path / "no_vllm" / "vllm"
    blocked.mkdir(parents=True, exist_ok=True)
    (blocked / "__init__.py").write_text("raise ImportError('vLLM is not installed on the GPU machine')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "GPU_CHECK_BOUNDED", "TRITON_INTERPRET")}
    return {**env, "PYTHON": sys.executable, "PYTHONPATH": str(blocked.parent), "EXLLAMAV3_EXT_DIR": str(tmp_path),
            **extra}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(args: list[str], env: dict[str, str], timeout: float,
         command: tuple[str, ...] = ("bash", str(SCRIPT)), cwd: Path | None = None
         ) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    result = subprocess.run([*command, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    return result, time.monotonic() - start


def test_dry_run_walks_every_step_appends_each_result_and_skips_the_engine_without_vllm(tmp_path: Path) -> None:
    out = tmp_path / "results"
    result, _ = _run(["--dry-run", str(out)], _env(tmp_path), timeout=2000)
    assert result.returncode == 0, result.stdout[-4000:]
    steps = _rows(out / "gpu-check.jsonl")
    assert [next(name for name in STEPS if r["step"].startswith(name)) for r in steps] == STEPS
    by_status = {r["step"].split(":")[0]: r["status"] for r in steps}
    assert all(status == "passed" for step, status in by_status.items() if not step.startswith("tiny")), steps
    engine = [r for r in steps if r["step"].startswith("tiny")]
    assert [(r["status"], r["reason"]) for r in engine] == [("skipped", "no vLLM on this machine")] * 2
    assert steps[-1]["status"] == "passed" and "no vLLM on this machine" in steps[-1]["skipped"]
    # The probe's and the benchmark's rows landed beside the steps', the benchmark's rooflines from the probe's.
    probe = _rows(out / "probe.jsonl")
    assert probe[-1]["probe"] == "rooflines" and {"hbm_read", "host_read", "h2d_copy", "pattern"} <= {
        r["probe"] for r in probe}
    bench = _rows(out / "bench.jsonl")
    assert bench[0]["row"] == "setup" and bench[0]["rooflines"] == probe[-1]
    assert {r["row"] for r in bench} >= {"moe", "moe_fp16_dense", "linear"}
    log = (out / "gpu-check.log").read_text()
    assert "== GPU tests" in log and "gpu-check: all steps that could run passed" in log
    # Each step's budget and where it comes from, before the first step: the compile census for those that compile.
    budgets = log[log.index("== step budgets"):log.index("== machine")]
    assert all(f"   {plan.name}: " in budgets for plan in gpu_check_budget.STEPS)
    assert re.search(r"   GPU tests: \d+ s = run \d+ s \+ compile \d+ s \(census", budgets)


def test_without_cuda_it_exits_2_at_once_having_checked_nothing(tmp_path: Path) -> None:
    """Run as `./gpu-check.sh` from scripts/: the script re-executes itself under its time bound after changing to
    the repository root, so it must re-execute its absolute path (a relative $0 no longer resolves there)."""
    out = tmp_path / "results"
    result, seconds = _run([str(out)], _env(tmp_path), timeout=120, command=("./gpu-check.sh",), cwd=SCRIPT.parent)
    assert result.returncode == 2 and "no CUDA device" in result.stdout  # the script logs stderr with stdout
    assert seconds < 60 and _rows(out / "gpu-check.jsonl") == [
        {"step": "cuda", "status": "failed", "reason": f"no CUDA device visible to {sys.executable}'s torch"}]


@pytest.mark.parametrize("total_s", [100])
def test_the_run_is_bounded_and_steps_it_cannot_reach_fail_it(tmp_path: Path, total_s: int) -> None:
    """A run that cannot finish inside its bound stops there, keeps every result so far, and is no pass; a step
    whose budget no longer fits is not started (a step killed mid-compile measures nothing), so none times out.
    (Budgets at their real size here: GPU_CHECK_DRY_SLACK=1, machine 20 s fits, the rest soon does not.)"""
    out = tmp_path / "results"
    env = _env(tmp_path, GPU_CHECK_TOTAL_S=str(total_s), GPU_CHECK_DRY_SLACK="1")
    result, seconds = _run(["--dry-run", str(out)], env, timeout=300)
    assert result.returncode == 1 and seconds < total_s + 15
    steps = _rows(out / "gpu-check.jsonl")
    assert steps[0] == {"step": "machine", "status": "passed", "seconds": 0, "dry_run": 1}
    unreached = [r for r in steps if r.get("reason", "").startswith(("not run", "timed out"))]
    assert unreached and all(r["status"] == "failed" and re.match(r"not run: needs \d+ s \(run \d+ s", r["reason"])
                             for r in unreached)
    assert steps[-1]["step"] == "summary" and steps[-1]["status"] == "failed"
    assert "gpu-check: FAILED" in result.stdout
