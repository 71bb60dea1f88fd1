"""scripts/gpu-check.sh on the CPU: --dry-run walks every step of the real run with the CUDA parts stubbed (the
plumbing a lent GPU machine will run: step order, bounds, results appended as JSON lines, vLLM's absence as a skip),
and without --dry-run it refuses at once. The GPU machine has no vLLM; a `vllm` that fails to import stands in for it."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import signal
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from support.paths import REPO
from vllm_expert_offload.kernels.triton_dequantize import split_fold
from vllm_expert_offload.tools import gpu_check_budget

SCRIPT = REPO / "scripts" / "gpu-check.sh"
# The essentials first (arena, tables, host tier, the Triton MoE against the torch reference, graph replay: side by
# side), the benchmarks after them, alone. The CPU tier's extension is built from the start, in the background, and
# recorded once the side-by-side steps have ended.
STEPS = ["machine", "versions", "imports without vLLM", "topology", "mapped host memory", "CPU tier on the GPU",
         "Triton MoE vs torch reference", "Triton prefill", "Triton mixed rates",
         *(f"Triton every rate {lane}: " for lane in ("k1-1.5", "k2-2.5", "k3-3.5", "k4-5", "k6-7", "k8")),
         "exllamav3 kernels", "compiled Triton forwards", "compiled exllamav3 forwards", "CPU tier extension",
         "bandwidth probe", "kernel benchmark", "tiny EXL3 MoE on the CUDA engine", "tiny mixed pack", "summary"]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    blocked = tmp_path / "no_vllm" / "vllm"
    blocked.mkdir(parents=True, exist_ok=True)
    (blocked / "__init__.py").write_text("raise ImportError('vLLM is not installed on the GPU machine')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "GPU_CHECK_BOUNDED", "TRITON_INTERPRET")}
    return {**env, "PYTHON": sys.executable, "PYTHONPATH": str(blocked.parent), "EXLLAMAV3_EXT_DIR": str(tmp_path),
            **extra}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_what_comes_back_whole(results: Path) -> None:
    """The device tool sends back from $OUT at most 8 plain files, 16 MiB each and 64 MiB in all, none more than 2
    folders down, every file and folder named in letters, digits, '.', '_' and '-' (docs/development.md): what
    breaks a rule is left behind, so RESULTS_DIR must keep them all, whatever the run did."""
    entries = list(results.rglob("*"))
    files = [p for p in entries if not p.is_dir()]
    assert all(p.is_file() and not p.is_symlink() for p in files), entries
    assert len(files) <= 8, sorted(str(p.relative_to(results)) for p in files)
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", p.name) for p in entries), entries
    assert all(len(p.relative_to(results).parts) <= 3 for p in files), files
    sizes = [p.stat().st_size for p in files]
    assert max(sizes) <= 16 << 20 and sum(sizes) <= 64 << 20, sizes


def _lane_logs(results: Path) -> dict[str, str]:
    """lanes.tar.gz's logs, by name (NN-step.log)."""
    with tarfile.open(results / "lanes.tar.gz") as archive:
        return {Path(m.name).name: archive.extractfile(m).read().decode() for m in archive.getmembers() if m.isfile()}


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
    assert "== Triton MoE vs torch reference" in log and "gpu-check: all steps that could run passed" in log
    # What comes back from the lent machine: every result file, the side-by-side steps' logs in one archive (one log
    # per step, numbered in the order they started), the machine they ran on; no autotune cache.
    assert_what_comes_back_whole(out)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["gpu-check.jsonl", "gpu-check.log", "machine.txt", "probe.jsonl", "bench.jsonl", "lanes.tar.gz"])
    beside = [r for r in steps if any(r["step"].startswith(plan.name) for plan in gpu_check_budget.STEPS
                                      if plan.beside)]
    logs = _lane_logs(out)  # the background step's first, then the side-by-side steps'
    names = sorted(logs)
    assert len(logs) == len(beside) + 1 >= 6 and names[3].startswith("04-mapped-host-memory"), names
    assert all(re.fullmatch(r"\d\d-[A-Za-z0-9-]+\.log", name) for name in logs)
    assert "test_arena.py" in logs[names[3]]
    # The CPU tier's tests started once its extension's build (here its --check, after a stand-in delay) had ended.
    assert names[0] == "01-CPU-tier-extension.log" and "vllm_expert_offload_exl3_cpu: " in logs[names[0]]
    assert re.match(r"== CPU tier extension has ended \(waited \d+ s\): this step starts\n", logs[names[4]])
    assert "test_stream_host_tier.py" in logs[names[4]]
    machine = (out / "machine.txt").read_text()
    assert "dry run: nvidia-smi not queried" in machine and "Architecture" in machine  # lscpu's
    assert re.search(r"^torch \d", machine, re.M) and re.search(r"^pytest \d", machine, re.M)
    # Each step's budget and where it comes from, before the first step: the compile census for those that compile.
    budgets = log[log.index("== step budgets"):log.index("== machine")]
    assert all(f"   {plan.name}: " in budgets for plan in gpu_check_budget.STEPS)
    assert re.search(r"   Triton MoE vs torch reference: \d+ s = run \d+ s \+ compile \d+ s \(census", budgets)
    assert_the_whole_run_fits_one_command(budgets)


def test_a_failed_extension_build_fails_the_run_and_leaves_out_only_the_cpu_tier_lane(tmp_path: Path) -> None:
    """Without a compiler the CPU tier's extension is refused, saying why; the lane that waits for it is not run (it
    would compile it at first use, unpriced), and every other step runs and passes."""
    out = tmp_path / "results"
    env = _env(tmp_path, CXX="/nonexistent/c++", TORCH_EXTENSIONS_DIR=str(tmp_path / "extensions"))
    result, _ = _run(["--dry-run", str(out)], env, timeout=2000)
    assert result.returncode == 1, result.stdout[-4000:]
    rows = {r["step"].split(":")[0]: r for r in _rows(out / "gpu-check.jsonl")}
    build, lane = rows["CPU tier extension"], rows["CPU tier on the GPU"]
    assert build["status"] == "failed" and "missing a C++ compiler ('/nonexistent/c++'" in build["tail"]
    assert (lane["status"], lane["reason"]) == ("failed", "not run: CPU tier extension failed (exit 1)")
    others = [r for name, r in rows.items() if name not in {"CPU tier extension", "CPU tier on the GPU", "summary"}]
    assert all(r["status"] in ("passed", "skipped") for r in others) and len(others) == len(STEPS) - 3
    assert_what_comes_back_whole(out)


def assert_the_whole_run_fits_one_command(budgets: str) -> None:
    """The lent machine's run, as the dry run prints its budgets: every step that runs there (no vLLM: not the
    engine's), a side-by-side group as long as its longest, and the machine's start, inside one command with margin;
    no step of the GPU tests may need more than the command's bound on its own."""
    steps = dict(re.findall(r"^   (.+?): (\d+) s = ", budgets, re.M))
    # name: the background step it waits for, if any
    beside = dict(re.findall(r"^   (.+?): \d+ s = .*\[beside the other GPU tests(?:, after (.+))?\]$", budgets, re.M))
    background = re.findall(r"^   (.+?): \d+ s = .*\[in the background, beside the steps after it\]$", budgets, re.M)
    assert len(beside) >= 5 and {"mapped host memory", "Triton MoE vs torch reference"} <= beside.keys()
    assert list(steps).index("mapped host memory") < list(steps).index("bandwidth probe")
    assert background == [list(steps)[0]] and beside["CPU tier on the GPU"] == background[0]  # started first
    engine = set(gpu_check_budget.ENGINE_STEPS)
    alone = [name for name in steps if name not in {*beside, *background, *engine, "whole run"}]
    first = min(list(steps).index(name) for name in beside)
    before = sum(int(steps[name]) for name in alone if list(steps).index(name) < first)
    run = sum(int(steps[name]) for name in alone)  # and the group, where a waiting step starts at the build's end
    run += max(max(0, int(steps[waited]) - before) + int(steps[name]) if waited else int(steps[name])
               for name, waited in beside.items())
    assert run >= int(steps[background[0]])
    start = gpu_check_budget.MACHINE_START_S
    assert start >= 60 and run + start <= 480, budgets
    assert int(steps["whole run"]) == run + start, budgets  # the script prints what it runs under


def test_without_cuda_it_exits_2_at_once_having_checked_nothing(tmp_path: Path) -> None:
    """Run as `./gpu-check.sh` from scripts/: the script re-executes itself under its time bound after changing to
    the repository root, so it must re-execute its absolute path (a relative $0 no longer resolves there)."""
    out = tmp_path / "results"
    result, seconds = _run([str(out)], _env(tmp_path), timeout=120, command=("./gpu-check.sh",), cwd=SCRIPT.parent)
    assert result.returncode == 2 and "no CUDA device" in result.stdout  # the script logs stderr with stdout
    assert seconds < 60 and _rows(out / "gpu-check.jsonl") == [
        {"step": "cuda", "status": "failed", "reason": f"no CUDA device visible to {sys.executable}'s torch"}]


@pytest.mark.parametrize("total_s", [60])
def test_the_run_is_bounded_and_steps_it_cannot_reach_fail_it(tmp_path: Path, total_s: int) -> None:
    """A run that cannot finish inside its bound stops there, keeps every result so far, and is no pass; a step
    whose budget no longer fits is not started (a step killed mid-compile measures nothing), so none times out.
    (Budgets at their real size here: GPU_CHECK_DRY_SLACK=1, machine 10 s fits, the side-by-side GPU tests do not.)"""
    out = tmp_path / "results"
    env = _env(tmp_path, GPU_CHECK_TOTAL_S=str(total_s), GPU_CHECK_DRY_SLACK="1")
    result, seconds = _run(["--dry-run", str(out)], env, timeout=300)
    assert result.returncode == 1 and seconds < total_s + 15
    build, *steps = _rows(out / "gpu-check.jsonl")  # the CPU tier's extension (110 s) does not fit either
    assert build["step"].startswith("CPU tier extension") and build["reason"].startswith("not run: needs 110 s")
    assert steps[0]["step"] == "machine" and steps[0]["status"] == "passed" and steps[0]["seconds"] <= 2
    unreached = [r for r in steps if r.get("reason", "").startswith(("not run", "timed out"))]
    assert unreached and all(r["status"] == "failed" and re.match(r"not run: needs \d+ s \(run \d+ s", r["reason"])
                             for r in unreached)
    assert steps[-1]["step"] == "summary" and steps[-1]["status"] == "failed"
    assert "gpu-check: FAILED" in result.stdout
    assert_what_comes_back_whole(out)
    assert "Architecture" in (out / "machine.txt").read_text()  # the first step's, whatever follows


def test_a_run_cut_short_by_its_bound_still_sends_back_its_results_whole(tmp_path: Path) -> None:
    """At the run's bound `timeout` signals the script's whole process group, the log's tee included, mid side-by-side
    group: the steps then running fail as cut short (the tail of their output kept), their logs so far are packed
    into lanes.tar.gz, the summary fails the run, and RESULTS_DIR still holds what the device tool sends back. Each
    step's `timeout` runs it in a process group of its own, out of the signal's reach: the run stops those too, so no
    step (pytest, the background build) outlives it."""
    out = tmp_path / "results"
    log = out / "gpu-check.log"
    scratch = tmp_path / "scratch"  # every process of the run has it as TMPDIR
    scratch.mkdir()
    proc = subprocess.Popen(["bash", str(SCRIPT), "--dry-run", str(out)], env=_env(tmp_path, TMPDIR=str(scratch)),
                            text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while "== compiled exllamav3 forwards" not in (log.read_text() if log.exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGTERM)  # as `timeout` does at the bound
        assert proc.wait(timeout=30) == 1
        time.sleep(2)  # killed processes leave /proc when reaped (the steps themselves run for seconds more)
        assert _processes_with(f"TMPDIR={scratch}") == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert_what_comes_back_whole(out)
    steps = _rows(out / "gpu-check.jsonl")
    cut = [r for r in steps if r.get("reason", "").startswith("cut short")]
    assert cut and all(r["status"] == "failed" and "tail" in r for r in cut)
    assert any(r["step"].startswith("CPU tier extension") for r in steps)  # cut short, or recorded as it ended
    assert steps[-1]["step"] == "summary" and steps[-1]["status"] == "failed" and "cut short" in steps[-1]["failed"]
    logs = _lane_logs(out)
    assert len(logs) == len([plan for plan in gpu_check_budget.STEPS if plan.beside or plan.background]) >= len(cut)
    assert any(name.endswith("compiled-exllamav3-forwards.log") for name in logs)
    assert "cut short by the run's bound" in log.read_text()


def _processes_with(variable: str) -> list[str]:
    """The command lines of this user's processes whose environment holds `variable` (NAME=VALUE)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if variable.encode() in environ.read_bytes().split(b"\0"):
                found.append((environ.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:  # gone, or another user's
            continue
    return found


def _gpu_test_module(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "tests" / "kernels" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_budget_prices_the_layers_forms_and_tokens_the_gpu_tests_launch() -> None:
    """gpu_check_budget cannot import the tests, so this holds its plan to them: a layer of one rate wherever a test
    is not about mixed rates, two rates and codebooks in the mixed-rate test (each rate's states and each codebook's
    branch compiled per call site), the every-rate check in one fold form, the device's (as the runtime derives it),
    over the lanes' tables (together every K and codebook, each lane's rates and codebooks as priced), and the token
    counts each step prices."""
    from support import moe_layers

    gpu = _gpu_test_module("test_triton_gpu")
    layer = lambda name, rates: gpu_check_budget.CensusLayer(  # noqa: E731
        name, moe_layers.HIDDEN, moe_layers.INTERMEDIATE, len(moe_layers.TIERS), 2, tuple(rates), "fp32")
    assert gpu_check_budget.TESTS_LAYER == layer("gpu-tests", moe_layers.UNIFORM) and len(moe_layers.UNIFORM) == 1
    assert gpu_check_budget.MIXED_LAYER == layer("gpu-tests-mixed", moe_layers.TWO_RATES)
    held = lambda rates: (len({k for k, _ in rates}), len({cb for _, cb in rates}))  # noqa: E731
    assert held(moe_layers.TWO_RATES) == (2, 2)
    assert (gpu_check_budget.DECODE_TOKENS, gpu_check_budget.GRAPH_TOKENS) == (gpu.DECODE_TOKENS, gpu.GRAPH_TOKENS)
    assert gpu_check_budget.PREFILL_TOKENS == (gpu.PREFILL_TOKENS,)
    assert gpu_check_budget.MIXED_TOKENS == (gpu.MIXED_TOKENS,)
    lanes = gpu.EVERY_RATE_LANES
    assert sorted(r for rates in lanes.values() for r in rates) == sorted(moe_layers.ALL_RATES)
    assert gpu_check_budget.EVERY_RATE_LANES == tuple((lane, *held(rates)) for lane, rates in lanes.items())
    cpu = torch.device("cpu")
    assert moe_layers.device_fold_form(cpu) == ((True, split_fold(cpu)),)
    assert len(moe_layers.EVERY_FORM) == 3  # the interpreter's check: every form


def test_one_fold_form_per_device_as_the_runtime_derives_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """sm_90 launches the whole fold, sm_120 the split one; the GPU test asks for that form alone."""
    from support import moe_layers

    for capability, split in ((90, False), (120, True)):
        split_fold.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, c=capability: divmod(c, 10))
        assert moe_layers.device_fold_form(torch.device("cuda", 0)) == ((True, split),)
    split_fold.cache_clear()


def test_the_every_rate_check_launches_only_the_forms_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """A form the GPU test does not ask for would compile a decode per rate all the same: each launch is recorded
    (and the check stopped at the first, having seen its form)."""
    from support import moe_layers

    class Launched(Exception):
        pass

    def launch(table, out, *, fold, split, **kwargs):
        raise Launched((fold, split))

    monkeypatch.setattr(moe_layers, "dequantize", launch)
    for form in moe_layers.EVERY_FORM:
        with pytest.raises(Launched) as launched:
            moe_layers.assert_dequantize_every_rate(torch.float16, torch.device("cpu"), (form,),
                                                    moe_layers.ALL_RATES[:4])
        assert launched.value.args[0] == form


@pytest.mark.parametrize("lane", ["k4-5", "k8"])
def test_a_lane_checks_every_rate_it_holds(monkeypatch: pytest.MonkeyPatch, lane: str) -> None:
    """The every-rate check leaves one matrix undecoded (below min_rows): an extra one, so that each (K, codebook) a
    lane asks for is decoded and compared, a lane of three (k8) too. In the interpreter, plain form (no compile)."""
    from support import moe_layers

    checked = []
    reference = moe_layers.rotated_weight
    monkeypatch.setattr(moe_layers, "rotated_weight", lambda layer: checked.append(layer.name) or reference(layer))
    rates = _gpu_test_module("test_triton_gpu").EVERY_RATE_LANES[lane]
    moe_layers.assert_dequantize_every_rate(torch.float32, torch.device("cpu"), ((False, False),), rates)
    assert len(checked) == len(rates) == len(set(checked))
